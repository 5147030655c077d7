//! `cargo bench -p vmm-bench`: vmm-core next to its baselines, then a summary table.
//! See vmm-bench/README.md for the figures, and `vmm_bench` for the code.

fn main() {
    // Children of this bench are this executable re-run: take the child's role first.
    vmm_core::process::init();
    // Baseline processes (a bare CUDA-init process, a no-op) do their one job and exit.
    vmm_bench::baseline_child_main();

    let settings = vmm_bench::Settings::from_env();
    let gpu = vmm_bench::gpu_or_exit();
    let mut criterion = settings.criterion();
    vmm_bench::run(&mut criterion, &gpu);
    criterion.final_summary();
    vmm_bench::report::finish(settings.quick, gpu, vmm_bench::is_measuring_run());
    vmm_bench::exit_if_fabric_required();
}
