//! Link settings for the `tierproxy` binary, both to keep the pages of the binary an agent
//! maps few (issue #7, peak RSS target).
//!
//! - On Linux with glibc: packed relative relocations (`DT_RELR`, `-z pack-relative-relocs`;
//!   binutils ≥ 2.38 or lld ≥ 15, glibc ≥ 2.36). A position-independent executable carries
//!   one relocation per pointer in its read-only data; as `RELA` entries (24 bytes each)
//!   the dynamic loader reads about 650 KB of them at every start, and those pages stay
//!   mapped: about 0.6 MiB of an idle agent's RSS. `RELR` encodes them in a few kilobytes.
//!   `TIERPROXY_NO_RELR=1` links without (an older toolchain or C library).
//! - On x86_64 Linux with glibc, where rustc links with its own lld: the functions in
//!   `dist/text-order.txt` (written by `dist/profile`: what lab agents ran under load) are
//!   placed first and together (`--symbol-ordering-file`). The kernel maps up to 64 KiB of
//!   a file around each page fault, so code scattered over the text maps most of it.
//!   Names not in the binary (other profiles, changed code) are skipped silently.
//!   `TIERPROXY_NO_TEXT_ORDER=1` links without (a linker other than lld).

use std::env::{var, var_os};
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=TIERPROXY_NO_RELR");
    println!("cargo:rerun-if-env-changed=TIERPROXY_NO_TEXT_ORDER");
    let linux_gnu = var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    if linux_gnu && var_os("TIERPROXY_NO_RELR").is_none() {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    let order =
        Path::new(&var_os("CARGO_MANIFEST_DIR").expect("set by cargo")).join("dist/text-order.txt");
    println!("cargo:rerun-if-changed={}", order.display());
    let lld = linux_gnu && var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    if lld && order.exists() && var_os("TIERPROXY_NO_TEXT_ORDER").is_none() {
        println!("cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}", order.display());
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
}
