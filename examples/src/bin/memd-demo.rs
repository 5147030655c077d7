//! `memd-demo`: publish the demo's weights to a running `vmm-memd`, or attach and check them
//! (see `vmm_examples::demo::USAGE`). Exit status 0 on success, 1 on a failure, 2 on a usage
//! error.

use vmm_examples::demo::{DemoError, run};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(if matches!(e, DemoError::Usage { .. }) {
                2
            } else {
                1
            });
        }
    }
}
