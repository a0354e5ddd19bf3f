//! Link settings for the `tierproxy` binary.
//!
//! On Linux with glibc the binary is linked with packed relative relocations (`DT_RELR`,
//! `ld -z pack-relative-relocs`, binutils ≥ 2.38, glibc ≥ 2.36). A position-independent
//! executable carries one relocation per pointer in its read-only data; as `RELA` entries
//! (24 bytes each) the dynamic loader reads about 650 KB of them at every start, and those
//! pages stay mapped: about 0.6 MiB of an idle agent's RSS. `RELR` encodes the same
//! relocations in a few kilobytes (issue #7, peak RSS target).
//!
//! Set `TIERPROXY_NO_RELR=1` to link without it (a toolchain or C library older than the
//! versions above).

fn main() {
    println!("cargo:rerun-if-env-changed=TIERPROXY_NO_RELR");
    let linux_gnu = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    if linux_gnu && std::env::var_os("TIERPROXY_NO_RELR").is_none() {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
