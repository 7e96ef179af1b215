//! Declares the cfgs of the schedule-explorer build (see `src/rt.rs` and
//! `tests/SHUTTLE.md`), so `--cfg keyorder_shuttle` raises no warning.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(keyorder_shuttle)");
    println!("cargo::rerun-if-changed=build.rs");
}
