//! What the registry tests share: a CA, a TLS etcd, clients for named owners, and a raw
//! etcd client (to write what a hostile owner could).

#![allow(dead_code)]

pub mod etcd;
pub mod handoff;
pub mod netns;
pub mod stand_in;

use std::net::SocketAddr;
use std::time::Duration;

use vmm_registry::{ExportedObject, HandleKind, Locator, Registry, RegistryConfig, TlsMaterial};

use etcd::{Etcd, EtcdTls, TempDir};
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
        self.raw(async |client| client.put(key, value, None).await.map(drop));
    }

    /// Turn etcd's RBAC on: users named by their certificates' names, `root` the
    /// administrator, each of `owners` reading the whole domain and writing only its own
    /// prefix.
    pub fn enable_rbac(&self, owners: &[&str]) {
        use etcd_client::{Permission, UserAddOptions};
        let owners: Vec<String> = owners.iter().map(|o| (*o).to_owned()).collect();
        self.raw_as("root", async |client| {
            client
                .user_add("root", "", Some(UserAddOptions::new().with_no_pwd()))
                .await?;
            client.user_grant_role("root", "root").await?;
            let domain = vmm_registry::domain_prefix(DOMAIN);
            for owner in &owners {
                client.role_add(owner.as_str()).await?;
                let own = format!("{domain}{owner}/");
                client
                    .role_grant_permission(
                        owner.as_str(),
                        Permission::read_write(own).with_prefix(),
                    )
                    .await?;
                client
                    .role_grant_permission(
                        owner.as_str(),
                        Permission::read(domain.clone()).with_prefix(),
                    )
                    .await?;
                client
                    .user_add(
                        owner.as_str(),
                        "",
                        Some(UserAddOptions::new().with_no_pwd()),
                    )
                    .await?;
                client
                    .user_grant_role(owner.as_str(), owner.as_str())
                    .await?;
            }
            client.auth_enable().await.map(drop)
        })
        .expect("enable RBAC");
    }

    /// Compact etcd's history up to its current revision.
    pub fn raw_compact(&self) {
        self.raw(async |client| {
            let revision = client
                .get("/", None)
                .await?
                .header()
                .map_or(0, |h| h.revision());
            client.compact(revision, None).await.map(drop)
        });
    }

    /// Revoke lease `id` directly (as an operator could).
    pub fn raw_revoke(&self, id: i64) {
        self.raw(async |client| client.lease_revoke(id).await.map(drop));
    }

    /// Run `call` on a raw client of this etcd (5 s at most).
    pub fn raw(
        &self,
        call: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<(), etcd_client::Error>,
    ) {
        self.raw_as("raw", call).expect("raw call");
    }

    /// Run `call` on a raw client whose certificate names `user` (5 s at most).
    pub fn raw_as(
        &self,
        user: &str,
        call: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<(), etcd_client::Error>,
    ) -> Result<(), etcd_client::Error> {
        let leaf = issue(&self.pki, user);
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(self.pki.ca_pem()))
            .identity(etcd_client::Identity::from_pem(leaf.cert_pem, leaf.key_pem))
            .domain_name(dns_name(SERVER));
        let url = format!("https://{}", self.etcd.endpoint());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let options = etcd_client::ConnectOptions::new().with_tls(tls);
            let mut client = etcd_client::Client::connect([url], Some(options))
                .await
                .expect("raw connect");
            tokio::time::timeout(Duration::from_secs(5), call(&mut client))
                .await
                .expect("raw call in time")
        })
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
