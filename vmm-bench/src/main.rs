//! Placeholder main job until the benchmark issue lands.
fn main() {
    vmm_core::process::init();
}
