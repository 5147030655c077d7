//! The `vmm-memd` service: see `vmm_memd::cli`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(vmm_memd::cli::main(&args));
}
