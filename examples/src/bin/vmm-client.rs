//! `vmm-client NAME BUFFER [--expect-uid UID] [--check-seed SEED]`: connect to a `vmm-daemon`,
//! fetch BUFFER, import it, check its pattern. See `vmm_examples::client::run`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match vmm_examples::client::run(&args) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("vmm-client: {e}");
            std::process::exit(1);
        }
    }
}
