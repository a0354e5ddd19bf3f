//! Keeping the audit stream bounded without losing count: deny aggregation and token-bucket
//! rate limits. Both take the time as an argument, so tests drive them with a fake clock.
//!
//! Source: issue #4 "What gets logged" (identical denies within a window become one event
//! with a count; per-rule and node-wide token buckets; suppressed events are counted).

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Folds identical items offered within `window` of the first into one, counted.
///
/// The first item of a key opens a window; items of the same key until the window closes
/// only raise its count. [`Aggregator::due`] hands out each closed window's first item
/// with its count and the time of the last. At most `capacity` windows are open: a new key
/// beyond that closes the oldest window early (it is returned by the next `due`), so
/// memory is bounded and nothing is lost.
#[derive(Debug)]
pub struct Aggregator<K, T> {
    window: Duration,
    capacity: usize,
    open: HashMap<K, Window<T>>,
    /// Windows closed early for capacity.
    closed: Vec<Aggregated<T>>,
}

#[derive(Debug)]
struct Window<T> {
    item: T,
    count: u64,
    opened: Instant,
    last: Instant,
}

/// An item with the number of identical items it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregated<T> {
    /// The first item of its window.
    pub item: T,
    /// Items in the window, the first included (≥ 1).
    pub count: u64,
    /// When the last of them was offered.
    pub last: Instant,
}

impl<K: Hash + Eq + Clone, T> Aggregator<K, T> {
    /// An aggregator folding items over `window`, with at most `capacity` open windows
    /// (at least 1).
    pub fn new(window: Duration, capacity: usize) -> Self {
        Aggregator { window, capacity: capacity.max(1), open: HashMap::new(), closed: Vec::new() }
    }

    /// Offers `item` under `key` at `now`. Returns `true` when it opened a new window,
    /// `false` when it was folded into an open one.
    pub fn offer(&mut self, key: K, item: T, now: Instant) -> bool {
        if let Some(w) = self.open.get_mut(&key)
            && now.saturating_duration_since(w.opened) < self.window
        {
            w.count += 1;
            w.last = now;
            return false;
        }
        if let Some(w) = self.open.remove(&key) {
            self.closed.push(Aggregated { item: w.item, count: w.count, last: w.last });
        }
        if self.open.len() >= self.capacity
            && let Some(oldest) =
                self.open.iter().min_by_key(|(_, w)| w.opened).map(|(k, _)| k.clone())
            && let Some(w) = self.open.remove(&oldest)
        {
            self.closed.push(Aggregated { item: w.item, count: w.count, last: w.last });
        }
        self.open.insert(key, Window { item, count: 1, opened: now, last: now });
        true
    }

    /// The windows closed by `now` (opened at least `window` ago, or closed early), in no
    /// particular order.
    pub fn due(&mut self, now: Instant) -> Vec<Aggregated<T>> {
        let mut out = std::mem::take(&mut self.closed);
        let window = self.window;
        let keys: Vec<K> = self
            .open
            .iter()
            .filter(|(_, w)| now.saturating_duration_since(w.opened) >= window)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            if let Some(w) = self.open.remove(&k) {
                out.push(Aggregated { item: w.item, count: w.count, last: w.last });
            }
        }
        out
    }

    /// Every window, closed or not (at shutdown).
    pub fn drain(&mut self) -> Vec<Aggregated<T>> {
        let mut out = std::mem::take(&mut self.closed);
        out.extend(self.open.drain().map(|(_, w)| Aggregated {
            item: w.item,
            count: w.count,
            last: w.last,
        }));
        out
    }

    /// Open windows.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no window is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

/// A token bucket: `rate` tokens per second, holding at most `burst`.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// A full bucket. `rate` ≤ 0 means unlimited.
    pub fn new(rate: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Bucket { rate, burst, tokens: burst, last: now }
    }

    /// Takes one token at `now`; `false` when the bucket is empty.
    pub fn take(&mut self, now: Instant) -> bool {
        if self.rate <= 0.0 {
            return true;
        }
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Rate limits: events per second, per rule and for the whole node (0 = unlimited).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Per rule (per policy, direction and rule; default allows and isolation denies count
    /// under their policy or `default`).
    pub per_rule: f64,
    /// For the node.
    pub node: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { per_rule: 100.0, node: 5_000.0 }
    }
}

/// Per-rule and node-wide token buckets, with counts of what each suppressed.
#[derive(Debug)]
pub struct RateLimiter<K> {
    limits: Limits,
    node: Bucket,
    rules: HashMap<K, Bucket>,
    /// Suppressed since the last [`RateLimiter::take_suppressed`], by rule key.
    suppressed_rule: HashMap<K, u64>,
    suppressed_node: u64,
}

/// Most rule buckets kept; beyond it the idle ones are forgotten (a forgotten bucket comes
/// back full, which errs on the side of logging).
const MAX_RULE_BUCKETS: usize = 65_536;

/// What [`RateLimiter::check`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Emit the event.
    Yes,
    /// Suppressed by the rule's bucket.
    RuleLimited,
    /// Suppressed by the node's bucket.
    NodeLimited,
}

impl<K: Hash + Eq + Clone> RateLimiter<K> {
    /// Limiter with `limits`, buckets full at `now`. Bursts are one second's worth.
    pub fn new(limits: Limits, now: Instant) -> Self {
        RateLimiter {
            limits,
            node: Bucket::new(limits.node, burst(limits.node), now),
            rules: HashMap::new(),
            suppressed_rule: HashMap::new(),
            suppressed_node: 0,
        }
    }

    /// Whether an event of the rule `key()` names may be emitted at `now`; counts it if
    /// not. `key` is called only when a per-rule limit is set.
    pub fn check(&mut self, key: impl FnOnce() -> K, now: Instant) -> Admit {
        if self.limits.per_rule > 0.0 {
            let key = key();
            if !self.rules.contains_key(&key) && self.rules.len() >= MAX_RULE_BUCKETS {
                self.rules.retain(|_, b| b.tokens < b.burst);
            }
            let rate = self.limits.per_rule;
            let b = self
                .rules
                .entry(key.clone())
                .or_insert_with(|| Bucket::new(rate, burst(rate), now));
            if !b.take(now) {
                *self.suppressed_rule.entry(key).or_default() += 1;
                return Admit::RuleLimited;
            }
        }
        if !self.node.take(now) {
            self.suppressed_node += 1;
            return Admit::NodeLimited;
        }
        Admit::Yes
    }

    /// What was suppressed since the last call: by rule key, and by the node's limit.
    pub fn take_suppressed(&mut self) -> (Vec<(K, u64)>, u64) {
        (self.suppressed_rule.drain().collect(), std::mem::take(&mut self.suppressed_node))
    }
}

fn burst(rate: f64) -> u32 {
    if rate <= 0.0 { 1 } else { rate.ceil().min(f64::from(u32::MAX)) as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_items_in_a_window_become_one_with_a_count() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a: Aggregator<&str, u32> = Aggregator::new(Duration::from_secs(1), 16);
        assert!(a.offer("k", 1, ms(0)));
        assert!(!a.offer("k", 2, ms(300)));
        assert!(!a.offer("k", 3, ms(999)));
        assert!(a.offer("other", 9, ms(500)));
        assert!(a.due(ms(999)).is_empty());
        let due = a.due(ms(1000));
        assert_eq!(due, vec![Aggregated { item: 1, count: 3, last: ms(999) }]);
        // After its window, the same key opens a new one.
        assert!(a.offer("k", 4, ms(1000)));
        let mut rest = a.drain();
        rest.sort_by_key(|x| x.item);
        assert_eq!(rest.iter().map(|x| (x.item, x.count)).collect::<Vec<_>>(), [(4, 1), (9, 1)]);
    }

    #[test]
    fn a_late_item_closes_the_stale_window_and_opens_its_own() {
        let t0 = Instant::now();
        let mut a: Aggregator<u8, u32> = Aggregator::new(Duration::from_secs(1), 16);
        a.offer(1, 10, t0);
        a.offer(1, 11, t0 + Duration::from_millis(100));
        // No `due` in between: the next offer after the window must not be folded.
        assert!(a.offer(1, 12, t0 + Duration::from_secs(2)));
        let mut all = a.drain();
        all.sort_by_key(|x| x.item);
        assert_eq!(all.iter().map(|x| (x.item, x.count)).collect::<Vec<_>>(), [(10, 2), (12, 1)]);
    }

    #[test]
    fn capacity_closes_the_oldest_window_early_and_loses_nothing() {
        let t0 = Instant::now();
        let mut a: Aggregator<u32, u32> = Aggregator::new(Duration::from_secs(60), 2);
        for k in 0..5 {
            a.offer(k, k, t0 + Duration::from_millis(u64::from(k)));
            a.offer(k, k + 100, t0 + Duration::from_millis(u64::from(k)));
        }
        assert_eq!(a.len(), 2);
        let early = a.due(t0 + Duration::from_millis(10));
        let mut items: Vec<_> = early.iter().map(|x| (x.item, x.count)).collect();
        items.sort();
        assert_eq!(items, [(0, 2), (1, 2), (2, 2)]);
        assert_eq!(a.drain().iter().map(|x| x.count).sum::<u64>(), 4);
    }

    #[test]
    fn buckets_refill_at_their_rate_and_count_what_they_suppress() {
        let t0 = Instant::now();
        let mut r: RateLimiter<&str> = RateLimiter::new(Limits { per_rule: 2.0, node: 3.0 }, t0);
        assert_eq!(r.check(|| "a", t0), Admit::Yes);
        assert_eq!(r.check(|| "a", t0), Admit::Yes);
        assert_eq!(r.check(|| "a", t0), Admit::RuleLimited);
        assert_eq!(r.check(|| "b", t0), Admit::Yes);
        // The node's 3 tokens are gone.
        assert_eq!(r.check(|| "c", t0), Admit::NodeLimited);
        let (mut by_rule, node) = r.take_suppressed();
        by_rule.sort();
        assert_eq!((by_rule, node), (vec![("a", 1)], 1));
        assert_eq!(r.take_suppressed(), (vec![], 0));
        // Half a second later: one token for rule a (rate 2/s), 1.5 for the node.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(r.check(|| "a", t1), Admit::Yes);
        assert_eq!(r.check(|| "a", t1), Admit::RuleLimited);
        // Unlimited when the rates are 0.
        let mut u: RateLimiter<u8> = RateLimiter::new(Limits { per_rule: 0.0, node: 0.0 }, t0);
        assert!((0..10_000).all(|_| u.check(|| 1, t0) == Admit::Yes));
    }
}
