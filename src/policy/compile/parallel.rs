//! Spreading the large passes of a compile over threads: contiguous ranges of about equal
//! work, the first run on the calling thread, the others on scoped threads; or, where an
//! item's weight foretells its cost badly (matcher builds), batches that each thread
//! claims as it becomes free ([`par_map_claimed`]).
//!
//! Results come back in range (or item) order: what a compile produces may depend on the
//! number of ranges, never on thread timing.

/// Below this many peers in all admin objects together, compiling stays on the calling
/// thread (spawning costs more than it saves).
pub(super) const PARALLEL_MIN_PEERS: usize = 4096;

/// Most threads a compile uses: enough for a large input on a small node, few enough not
/// to crowd a big node while the agent rebuilds.
const MAX_WORKERS: usize = 4;

/// The machine's parallelism, at most [`MAX_WORKERS`].
pub(super) fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_WORKERS)
}

/// Splits items of the given weights into at most `workers` contiguous ranges of about
/// equal total weight (one range when the total is below [`PARALLEL_MIN_PEERS`]).
pub(super) fn balanced_ranges(weights: &[usize], workers: usize) -> Vec<std::ops::Range<usize>> {
    let total: usize = weights.iter().sum();
    let workers = workers_for(total, workers);
    let mut out = Vec::with_capacity(workers);
    let (mut start, mut acc) = (0, 0);
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        if out.len() + 1 < workers && acc * workers >= total * (out.len() + 1) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out.push(start..weights.len());
    out
}

/// How many of `workers` threads work of `total` weight is spread over: one below
/// [`PARALLEL_MIN_PEERS`].
pub(super) fn workers_for(total: usize, workers: usize) -> usize {
    if total < PARALLEL_MIN_PEERS { 1 } else { workers.max(1) }
}

/// Maps every item with `work` on `workers` threads (the calling thread and scoped ones)
/// that claim the next `batch` items until none are left, so a thread that drew cheap
/// items takes more of them: for work whose cost its weight foretells badly (a matcher's
/// build depends on how its sets' pods overlap). Each thread gets its own state from
/// `init`. Results come back in item order; which thread mapped an item must not change
/// its result. A panic in a worker is resumed on the caller.
pub(super) fn par_map_claimed<T: Sync, S, R: Send>(
    items: &[T],
    workers: usize,
    batch: usize,
    init: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, &T) -> R + Sync,
) -> Vec<R> {
    let batch = batch.max(1);
    if workers <= 1 || items.len() <= batch {
        let mut state = init();
        return items.iter().map(|it| work(&mut state, it)).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let claim = || {
        let mut state = init();
        let mut done: Vec<(usize, Vec<R>)> = Vec::new();
        loop {
            let start = next.fetch_add(batch, std::sync::atomic::Ordering::Relaxed);
            if start >= items.len() {
                return done;
            }
            let end = (start + batch).min(items.len());
            done.push((start, items[start..end].iter().map(|it| work(&mut state, it)).collect()));
        }
    };
    let mut batches = std::thread::scope(|scope| {
        let handles: Vec<_> = (1..workers).map(|_| scope.spawn(claim)).collect();
        let mut all = claim();
        for h in handles {
            all.extend(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        all
    });
    batches.sort_unstable_by_key(|&(start, _)| start);
    batches.into_iter().flat_map(|(_, r)| r).collect()
}

/// Runs `work` on each range of `items` (from [`balanced_ranges`]), the first on the
/// calling thread and the others on scoped threads, and returns the results in range order.
/// A panic in a worker is resumed on the caller.
pub(super) fn par_ranges<T: Sync, R: Send>(
    items: &[T],
    ranges: &[std::ops::Range<usize>],
    work: impl Fn(usize, &[T]) -> R + Sync,
) -> Vec<R> {
    if ranges.len() <= 1 {
        return vec![work(0, items)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranges[1..]
            .iter()
            .enumerate()
            .map(|(w, r)| {
                let (work, chunk) = (&work, &items[r.clone()]);
                scope.spawn(move || work(w + 1, chunk))
            })
            .collect();
        let mut out = vec![work(0, &items[ranges[0].clone()])];
        for h in handles {
            out.push(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        out
    })
}

/// Runs `work` on every item, the items split into `ranges` (contiguous, covering them
/// all, from [`balanced_ranges`]): the first range on the calling thread, the others on
/// scoped threads. A panic in a worker is resumed on the caller.
pub(super) fn par_for_each_mut<T: Send>(
    items: &mut [T],
    ranges: &[std::ops::Range<usize>],
    work: impl Fn(&mut T) + Sync,
) {
    if ranges.len() <= 1 {
        items.iter_mut().for_each(work);
        return;
    }
    std::thread::scope(|scope| {
        let (first, mut rest) = items.split_at_mut(ranges[0].len());
        let mut handles = Vec::with_capacity(ranges.len() - 1);
        for r in &ranges[1..] {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            rest = tail;
            let work = &work;
            handles.push(scope.spawn(move || mine.iter_mut().for_each(work)));
        }
        first.iter_mut().for_each(&work);
        for h in handles {
            h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_ranges_cover_every_item_once_in_order() {
        let weights: Vec<usize> = (0..50).map(|i| 1 + (i * 37) % 500).collect();
        for workers in 1..=5 {
            let ranges = balanced_ranges(&weights, workers);
            assert!(ranges.len() <= workers.max(1));
            assert_eq!(ranges.first().map(|r| r.start), Some(0));
            assert_eq!(ranges.last().map(|r| r.end), Some(weights.len()));
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        }
        // Small inputs stay on the calling thread.
        assert_eq!(balanced_ranges(&[1, 2, 3], 4), vec![0..3]);
        assert_eq!(balanced_ranges(&[], 4), vec![0..0]);
    }

    #[test]
    fn claimed_batches_map_every_item_once_in_order_on_every_thread() {
        let items: Vec<u64> = (0..1_000).collect();
        for (workers, batch) in [(1, 4), (2, 1), (2, 7), (3, 4), (4, 1_000), (4, 2_000)] {
            let threads = std::sync::Mutex::new(std::collections::HashSet::new());
            let out = par_map_claimed(
                &items,
                workers,
                batch,
                || 0usize,
                |mapped, &x| {
                    *mapped += 1;
                    threads.lock().unwrap().insert(std::thread::current().id());
                    x * x
                },
            );
            assert_eq!(out, items.iter().map(|x| x * x).collect::<Vec<_>>(), "{workers}/{batch}");
            assert!(threads.into_inner().unwrap().len() <= workers);
        }
        assert!(par_map_claimed(&[] as &[u8], 4, 4, || (), |_, &x| x).is_empty());
    }
}
