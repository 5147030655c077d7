//! What the registry tests share: a CA, a TLS etcd, clients for named owners, and a raw
//! etcd client (to write what a hostile owner could).

#![allow(dead_code)]

pub mod etcd;
pub mod handoff;
pub mod netns;
pub mod raw;
pub mod stand_in;

use std::net::SocketAddr;
use std::time::Duration;

use vmm_registry::{ExportedObject, HandleKind, Locator, Registry, RegistryConfig, TlsMaterial};

use etcd::{Etcd, EtcdTls, TempDir};
use raw::{Access, Raw};
use vmm_tests::pki::{Leaf, LeafSpec, Pki, dns_name};

/// The domain every test publishes in.
pub const DOMAIN: &str = "test";

/// The name etcd's certificate carries.
pub const SERVER: &str = "etcd";

/// A CA, its files, and an etcd whose certificate it signed.
#[derive(Debug)]
pub struct World {
    pub pki: Pki,
    pub dir: TempDir,
    pub etcd: Etcd,
}

impl World {
    /// A CA and a TLS etcd, or `None` (after a SKIP line) where etcd is not installed.
    pub fn start(test: &str) -> Option<World> {
        let binary = etcd::etcd_or_skip(test)?;
        let pki = Pki::new("registry");
        let dir = TempDir::new("pki");
        let tls = etcd_tls(&pki, &dir);
        let etcd = Etcd::start(&binary, Some(tls), None);
        Some(World { pki, dir, etcd })
    }

    /// TLS material for a client called `owner`, issued by the world's CA.
    pub fn material(&self, owner: &str) -> TlsMaterial {
        material(&self.pki, owner, SERVER)
    }

    /// Write the CA and a certificate and key for `owner` into the world's directory (for a
    /// child process); the directory.
    pub fn write_material(&self, owner: &str) -> std::path::PathBuf {
        write_material(&self.pki, &self.dir.0, owner)
    }

    /// A config for `owner` against this etcd, with a short TTL and deadlines.
    pub fn config(&self, owner: &str) -> RegistryConfig {
        RegistryConfig::new([self.etcd.endpoint()], self.material(owner), DOMAIN, owner)
            .lease_ttl(Duration::from_secs(2))
            .call_timeout(Duration::from_secs(3))
            .open_timeout(Duration::from_secs(5))
    }

    /// An open registry for `owner`.
    pub fn open(&self, owner: &str) -> Registry {
        Registry::open(self.config(owner)).expect("open the registry")
    }

    /// Put `value` at `key` directly (as a hostile owner could, before RBAC).
    pub fn raw_put(&self, key: &str, value: Vec<u8>) {
        self.raw(async |client| client.put(key, value).await);
    }

    /// Turn etcd's RBAC on: users named by their certificates' names, `root` the
    /// administrator, each of `owners` reading the whole domain and writing only its own
    /// prefix.
    pub fn enable_rbac(&self, owners: &[&str]) {
        let owners: Vec<String> = owners.iter().map(|o| (*o).to_owned()).collect();
        self.raw_as("root", async |client| {
            client.user_add("root").await?;
            client.user_grant_role("root", "root").await?;
            let domain = vmm_registry::domain_prefix(DOMAIN);
            for owner in &owners {
                client.role_add(owner).await?;
                let own = format!("{domain}{owner}/");
                client
                    .role_grant_prefix(owner, &own, Access::ReadWrite)
                    .await?;
                client
                    .role_grant_prefix(owner, &domain, Access::Read)
                    .await?;
                client.user_add(owner).await?;
                client.user_grant_role(owner, owner).await?;
            }
            client.auth_enable().await
        })
        .expect("enable RBAC");
    }

    /// Compact etcd's history up to its current revision.
    pub fn raw_compact(&self) {
        self.raw(async |client| {
            let revision = client.revision().await?;
            client.compact(revision).await
        });
    }

    /// Revoke lease `id` directly (as an operator could).
    pub fn raw_revoke(&self, id: i64) {
        self.raw(async |client| client.lease_revoke(id).await);
    }

    /// The lease `owner`'s locator `name` is attached to (`None`: there is no such key), read
    /// directly; `Err` while etcd does not answer (5 s at most).
    pub fn key_lease(&self, owner: &str, name: &str) -> Result<Option<i64>, tonic::Status> {
        let key = vmm_registry::export_key(DOMAIN, owner, name);
        let (runtime, mut client) = self.raw_client("raw");
        runtime.block_on(async {
            match tokio::time::timeout(Duration::from_secs(5), client.get(key)).await {
                Ok(answer) => Ok(answer?.kvs.first().map(|kv| kv.lease)),
                Err(_) => Err(tonic::Status::deadline_exceeded("no answer within 5 s")),
            }
        })
    }

    /// Run `call` on a raw client of this etcd (5 s at most).
    pub fn raw(&self, call: impl AsyncFnOnce(&mut Raw) -> Result<(), tonic::Status>) {
        self.raw_as("raw", call).expect("raw call");
    }

    /// Run `call` on a raw client whose certificate names `user` (5 s at most).
    pub fn raw_as(
        &self,
        user: &str,
        call: impl AsyncFnOnce(&mut Raw) -> Result<(), tonic::Status>,
    ) -> Result<(), tonic::Status> {
        let (runtime, mut client) = self.raw_client(user);
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), call(&mut client))
                .await
                .expect("raw call in time")
        })
    }

    /// A current-thread runtime and a raw client on it whose certificate names `user`.
    pub fn raw_client(&self, user: &str) -> (tokio::runtime::Runtime, Raw) {
        let leaf = issue(&self.pki, user);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let client = {
            // The channel's tasks are spawned on the runtime, so it is made inside it.
            let _entered = runtime.enter();
            Raw::connect(
                &self.etcd.endpoint(),
                self.pki.ca_pem().as_bytes(),
                leaf.cert_pem.as_bytes(),
                leaf.key_pem.as_bytes(),
                &dns_name(SERVER),
            )
        };
        (runtime, client)
    }
}

/// A leaf called `name` (SAN `<name>.vmm.test`, common name `name`: the user etcd sees),
/// for client and server authentication, issued by `pki`.
pub fn issue(pki: &Pki, name: &str) -> Leaf {
    pki.issue(&LeafSpec::new(name))
}

/// Write `pki`'s CA (`ca.pem`) and a certificate and key for `owner` (`<owner>.pem`,
/// `<owner>.key`) into `dir`, for a child process; `dir`.
pub fn write_material(pki: &Pki, dir: &std::path::Path, owner: &str) -> std::path::PathBuf {
    issue(pki, owner).write(dir, owner);
    std::fs::write(dir.join("ca.pem"), pki.ca_pem()).expect("write the CA");
    dir.to_owned()
}

/// TLS material for a client called `owner`, issued by `pki`, expecting etcd's certificate
/// to name `server` (`<server>.vmm.test`).
pub fn material(pki: &Pki, owner: &str, server: &str) -> TlsMaterial {
    let leaf = issue(pki, owner);
    TlsMaterial::from_pem(pki.ca_pem(), leaf.cert_pem, leaf.key_pem, dns_name(server))
}

/// Write the server's certificate and the CA, and say how etcd uses them.
pub fn etcd_tls(pki: &Pki, dir: &TempDir) -> EtcdTls {
    let (cert, key) = issue(pki, SERVER).write(&dir.0, "etcd-server");
    let client_ca = dir.0.join("ca.pem");
    std::fs::write(&client_ca, pki.ca_pem()).expect("write the CA");
    EtcdTls {
        cert,
        key,
        client_ca,
    }
}

/// A locator `owner` could publish.
pub fn locator(owner: &str, generation: u64) -> Locator {
    Locator {
        owner: owner.into(),
        exporter_addr: SocketAddr::from(([127, 0, 0, 1], 7000)),
        exporter_name: dns_name(owner),
        object: ExportedObject::Region("kv-cache".into()),
        size: 64 << 20,
        device_uuid: None,
        handle: HandleKind::HostMemfd,
        generation,
    }
}
