//! `vmm-memctl`: operate a `vmm-memd` service; see `vmm_memd::ctl`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(vmm_memd::ctl::main(&args));
}
