//! A real etcd for one test: free loopback ports, a temporary data directory, TLS with
//! client-certificate authentication (peer traffic too), stopped with SIGTERM and cleaned up.
//! Where etcd is not installed a test prints one SKIP line and passes, unless
//! `VMM_REQUIRE_ETCD=1` or `VMM_REQUIRE_GPU=1` asks for a failure instead.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The etcd binary: `$VMM_ETCD_BIN`, or `etcd` on the `PATH`; `None` if there is none.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("VMM_ETCD_BIN") {
        return Some(PathBuf::from(path));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("etcd"))
        .find(|path| path.is_file())
}

/// Whether a missing etcd fails the test rather than skipping it.
fn strict() -> bool {
    ["VMM_REQUIRE_ETCD", "VMM_REQUIRE_GPU"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|v| v == "1"))
}

/// The etcd binary, or `None` after printing `SKIP <test>: ...` (a failure when strict).
pub fn etcd_or_skip(test: &str) -> Option<PathBuf> {
    match etcd_binary() {
        Some(path) => Some(path),
        None if strict() => panic!(
            "{test}: etcd is not installed (apt-get install etcd-server) and \
             VMM_REQUIRE_ETCD=1 or VMM_REQUIRE_GPU=1 is set"
        ),
        None => {
            eprintln!("SKIP {test}: etcd is not installed (apt-get install etcd-server)");
            None
        }
    }
}

/// A loopback port nothing listens on (right now).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("its address").port()
}

/// A temporary directory, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("vmm-registry-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create a temporary directory");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How the test etcd speaks to clients.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// Its certificate and key (PEM files).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA it trusts for client certificates (PEM file).
    pub client_ca: PathBuf,
}

/// One etcd process (restartable on the same ports and data).
#[derive(Debug)]
pub struct Etcd {
    binary: PathBuf,
    child: Option<Child>,
    dir: TempDir,
    pub client_port: u16,
    peer_port: u16,
    /// `None`: plaintext (only to prove the client never speaks it).
    tls: Option<EtcdTls>,
    /// The address it listens on (loopback unless in a network namespace).
    host: IpAddr,
    /// The network namespace it runs in (`ip netns exec`), if not this process's.
    netns: Option<String>,
}

impl Etcd {
    /// Start etcd on `client_port` (a free one if `None`), with TLS as `tls` says.
    pub fn start(binary: &Path, tls: Option<EtcdTls>, client_port: Option<u16>) -> Etcd {
        let mut etcd = Etcd {
            binary: binary.to_owned(),
            child: None,
            dir: TempDir::new("etcd"),
            client_port: client_port.unwrap_or_else(free_port),
            peer_port: free_port(),
            tls,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            netns: None,
        };
        etcd.launch();
        etcd
    }

    /// Start etcd with `tls` in the network namespace `netns`, listening on `host` (ports
    /// 2379 and 2380: the namespace is the test's own).
    pub fn start_in(binary: &Path, tls: EtcdTls, netns: &str, host: IpAddr) -> Etcd {
        let mut etcd = Etcd {
            binary: binary.to_owned(),
            child: None,
            dir: TempDir::new("etcd"),
            client_port: 2379,
            peer_port: 2380,
            tls: Some(tls),
            host,
            netns: Some(netns.to_owned()),
        };
        etcd.launch();
        etcd
    }

    /// `<host>:<client port>`.
    pub fn endpoint(&self) -> String {
        SocketAddr::new(self.host, self.client_port).to_string()
    }

    fn launch(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client_url = format!(
            "{scheme}://{}",
            SocketAddr::new(self.host, self.client_port)
        );
        let peer_url = format!("{scheme}://{}", SocketAddr::new(self.host, self.peer_port));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.0.join("etcd.log"))
            .expect("etcd's log file");
        let mut command = match &self.netns {
            // `ip netns exec` execs etcd: the child's pid is etcd's, for the signals below.
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", netns]).arg(&self.binary);
                command
            }
            None => Command::new(&self.binary),
        };
        command
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.0.join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=250")
            .arg("--logger=zap")
            .arg("--log-level=warn");
        if let Some(tls) = &self.tls {
            for prefix in ["", "peer-"] {
                command
                    .arg(format!("--{prefix}cert-file={}", tls.cert.display()))
                    .arg(format!("--{prefix}key-file={}", tls.key.display()))
                    .arg(format!(
                        "--{prefix}trusted-ca-file={}",
                        tls.client_ca.display()
                    ))
                    .arg(format!("--{prefix}client-cert-auth=true"));
            }
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("a second log handle"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_listening();
    }

    /// Until the client port accepts connections (10 s at most).
    fn wait_listening(&mut self) {
        let addr: SocketAddr = self.endpoint().parse().expect("an address");
        let deadline = Instant::now() + Duration::from_secs(10);
        let netns = self.netns.clone();
        let connects = move || {
            let connect = move || TcpStream::connect_timeout(&addr, Duration::from_millis(100));
            match &netns {
                Some(netns) => super::netns::within(netns, connect),
                None => connect(),
            }
        };
        while connects().is_err() {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("etcd exited at start ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not listen within 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What etcd logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("etcd.log")).unwrap_or_default()
    }

    /// Stop etcd with SIGTERM (SIGKILL after 5 s) and reap it.
    pub fn stop(&mut self) {
        self.end(Signal::SIGTERM);
    }

    /// SIGKILL etcd and reap it.
    pub fn kill(&mut self) {
        self.end(Signal::SIGKILL);
    }

    fn end(&mut self, signal: Signal) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("a pid"));
        let _ = kill(pid, signal);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGSTOP etcd (it holds every connection and answers nothing).
    ///
    /// Returns once every thread of etcd is stopped: `kill` returns before the kernel has
    /// stopped them, and a thread still running could answer one more request.
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
        let pid = self.child.as_ref().expect("etcd runs").id();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(pid) {
            assert!(Instant::now() < deadline, "etcd did not stop within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT etcd.
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    fn signal(&self, signal: Signal) {
        let child = self.child.as_ref().expect("etcd runs");
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("a pid"));
        kill(pid, signal).expect("signal etcd");
    }

    /// Start it again, on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Start it again after [`kill`](Self::kill) or [`stop`](Self::stop), on the same ports
    /// and data (an outage of the caller's length).
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "etcd still runs");
        self.launch();
    }

    /// SIGKILL it and start it again, on the same ports and data.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether every thread of `pid` is in the stopped state (`T`), read from `/proc`.
pub fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}
