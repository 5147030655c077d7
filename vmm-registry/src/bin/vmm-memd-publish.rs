//! `vmm-memd-publish`: publishes a vmm-memd service's regions in the registry (see
//! `vmm_registry::memd_publish` and `vmm-memd-publish --help`).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(vmm_registry::memd_publish::cli::main(&args));
}
