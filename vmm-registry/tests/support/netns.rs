//! Two "nodes" on one machine: two network namespaces joined by a veth pair on private
//! addresses of the test's choosing, removed again on drop (also when a test panics). Needs
//! root and `ip` (iproute2); where either is missing a test prints one SKIP line, unless
//! `VMM_REQUIRE_ETCD=1` asks for a failure instead.

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Run `f` on a thread that entered the network namespace `netns` (its sockets are made
/// there; the rest of the process stays where it is).
pub fn within<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{netns}");
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let file = std::fs::File::open(&path).expect("open the namespace");
                nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("enter the namespace");
                f()
            })
            .join()
            .expect("the namespace thread")
    })
}

/// Print `SKIP <test>: <reason>`, or fail under `VMM_REQUIRE_ETCD=1`.
pub fn skip_or_fail(test: &str, reason: &str) {
    if std::env::var("VMM_REQUIRE_ETCD").is_ok_and(|v| v == "1") {
        panic!("{test}: {reason}, and VMM_REQUIRE_ETCD=1 is set");
    }
    eprintln!("SKIP {test}: {reason}");
}

/// Two network namespaces `a` and `b`, joined by a veth pair: `addr_a` in `a`, `addr_b` in
/// `b`, one /30 of 10.250.0.0/16 (nothing else is routed in them, so the addresses cannot
/// meet the host's).
#[derive(Debug)]
pub struct TwoNodes {
    pub a: String,
    pub b: String,
    pub addr_a: Ipv4Addr,
    pub addr_b: Ipv4Addr,
    veth: String,
}

impl TwoNodes {
    /// Make them, or say why not (not root, no `ip`, namespaces refused).
    pub fn make() -> Result<TwoNodes, String> {
        if !is_root() {
            return Err("not root (network namespaces need CAP_SYS_ADMIN)".into());
        }
        match Command::new("ip").args(["netns", "list"]).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                return Err(format!(
                    "`ip netns` is unavailable: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Err(e) => return Err(format!("`ip` (iproute2) is not installed: {e}")),
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let subnet = u8::try_from((pid + n) % 254 + 1).expect("under 255");
        let nodes = TwoNodes {
            a: format!("vmmreg-{pid}-{n}-a"),
            b: format!("vmmreg-{pid}-{n}-b"),
            addr_a: Ipv4Addr::new(10, 250, subnet, 1),
            addr_b: Ipv4Addr::new(10, 250, subnet, 2),
            // At most 15 bytes: "vr" + a pid of at most 7 digits + n + "a".
            veth: format!("vr{pid}{}", n % 10),
        };
        // A failure part way leaves what was made to the drop.
        let (veth_a, veth_b) = (format!("{}a", nodes.veth), format!("{}b", nodes.veth));
        let (addr_a, addr_b) = (
            format!("{}/30", nodes.addr_a),
            format!("{}/30", nodes.addr_b),
        );
        ip(&["netns", "add", &nodes.a])?;
        ip(&["netns", "add", &nodes.b])?;
        ip(&[
            "link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b,
        ])?;
        ip(&["link", "set", &veth_a, "netns", &nodes.a])?;
        ip(&["link", "set", &veth_b, "netns", &nodes.b])?;
        for (ns, dev, addr) in [(&nodes.a, &veth_a, &addr_a), (&nodes.b, &veth_b, &addr_b)] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(nodes)
    }

    /// A command that runs `program` in namespace `netns` (`ip netns exec`, which execs it:
    /// the child's pid is the program's).
    pub fn command(netns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", netns]).arg(program);
        command
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so the pair; the link
        // is deleted by name too in case it never left this namespace.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
        let _ = ip(&["link", "del", &format!("{}a", self.veth)]);
    }
}

/// Whether this process's effective uid is 0 (the second field of `Uid:` in
/// `/proc/self/status`).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Run `ip args...`; its stderr as the error.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A child process SIGKILLed and reaped on drop (so a failing test leaves none behind).
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
