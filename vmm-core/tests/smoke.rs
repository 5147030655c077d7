use std::time::Duration;
use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::HostBuffer;

fn child(buf: HostBuffer) {
    println!("child sees {}", buf.to_vec()[0]);
    buf.fill(0xAB).unwrap();
}

#[test]
fn smoke() {
    for method in StartMethod::ALL {
        let buf = HostBuffer::new(4096).unwrap();
        buf.fill(1).unwrap();
        let t = std::time::Instant::now();
        let p = Context::new(method).spawn(child, buf.clone()).unwrap();
        let r = p.join(Duration::from_secs(10));
        println!("{method}: {:?} in {:?}", r, t.elapsed());
        r.unwrap();
        assert_eq!(buf.to_vec()[0], 0xAB);
    }
}
