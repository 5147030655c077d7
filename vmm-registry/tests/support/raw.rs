//! A raw etcd client for the tests, apart from the registry's own: tonic's channel with a
//! certificate of the test's CA, and vmm-etcd-api's generated clients. It writes what a
//! hostile owner could, sets up etcd's RBAC, compacts and revokes.

use tonic::Status;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use vmm_etcd_api::authpb::{Permission, UserAddOptions, permission};
use vmm_etcd_api::etcdserverpb::auth_client::AuthClient;
use vmm_etcd_api::etcdserverpb::kv_client::KvClient;
use vmm_etcd_api::etcdserverpb::lease_client::LeaseClient;
use vmm_etcd_api::etcdserverpb::{
    AuthEnableRequest, AuthRoleAddRequest, AuthRoleGrantPermissionRequest, AuthUserAddRequest,
    AuthUserGrantRoleRequest, CompactionRequest, DeleteRangeRequest, LeaseRevokeRequest,
    PutRequest, RangeRequest, RangeResponse,
};

/// A connected raw client.
#[derive(Debug)]
pub struct Raw {
    pub kv: KvClient<Channel>,
    pub lease: LeaseClient<Channel>,
    pub auth: AuthClient<Channel>,
}

/// What a permission lets a role do.
#[derive(Debug, Clone, Copy)]
pub enum Access {
    Read,
    ReadWrite,
}

impl Raw {
    /// A client of `endpoint` (`host:port`) over mutual TLS: `cert_pem`/`key_pem` are the
    /// client's (its name is the etcd user), `ca_pem` signed etcd's certificate, which names
    /// `server`.
    pub fn connect(
        endpoint: &str,
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
        server: &str,
    ) -> Raw {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca_pem))
            .identity(Identity::from_pem(cert_pem, key_pem))
            .domain_name(server);
        // Lazy, as the registry's own channel: the connection is made at the first call and
        // served at once. (An eager connection left unused while a bench measures something
        // else was closed under it: its tasks run only while its runtime is driven.)
        let channel = Endpoint::from_shared(format!("https://{endpoint}"))
            .expect("an endpoint")
            .tls_config(tls)
            .expect("TLS material")
            .connect_lazy();
        Raw {
            kv: KvClient::new(channel.clone()),
            lease: LeaseClient::new(channel.clone()),
            auth: AuthClient::new(channel),
        }
    }

    /// Put `value` at `key`, with no lease.
    pub async fn put(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), Status> {
        let request = PutRequest {
            key: key.into(),
            value: value.into(),
            ..PutRequest::default()
        };
        self.kv.put(request).await.map(drop)
    }

    /// The value at `key`.
    pub async fn get(&mut self, key: impl Into<Vec<u8>>) -> Result<RangeResponse, Status> {
        let request = RangeRequest {
            key: key.into(),
            ..RangeRequest::default()
        };
        Ok(self.kv.range(request).await?.into_inner())
    }

    /// Delete `key`.
    pub async fn delete(&mut self, key: impl Into<Vec<u8>>) -> Result<(), Status> {
        let request = DeleteRangeRequest {
            key: key.into(),
            ..DeleteRangeRequest::default()
        };
        self.kv.delete_range(request).await.map(drop)
    }

    /// etcd's current revision.
    pub async fn revision(&mut self) -> Result<i64, Status> {
        let request = RangeRequest {
            key: b"/".to_vec(),
            ..RangeRequest::default()
        };
        let response = self.kv.range(request).await?.into_inner();
        Ok(response.header.map_or(0, |h| h.revision))
    }

    /// Compact etcd's history up to `revision`.
    pub async fn compact(&mut self, revision: i64) -> Result<(), Status> {
        let request = CompactionRequest {
            revision,
            physical: false,
        };
        self.kv.compact(request).await.map(drop)
    }

    /// Revoke lease `id`.
    pub async fn lease_revoke(&mut self, id: i64) -> Result<(), Status> {
        self.lease
            .lease_revoke(LeaseRevokeRequest { id })
            .await
            .map(drop)
    }

    /// Add user `name`, who has no password (it is known by its certificate's name).
    pub async fn user_add(&mut self, name: &str) -> Result<(), Status> {
        let request = AuthUserAddRequest {
            name: name.to_owned(),
            options: Some(UserAddOptions { no_password: true }),
            ..AuthUserAddRequest::default()
        };
        self.auth.user_add(request).await.map(drop)
    }

    /// Give user `user` role `role`.
    pub async fn user_grant_role(&mut self, user: &str, role: &str) -> Result<(), Status> {
        let request = AuthUserGrantRoleRequest {
            user: user.to_owned(),
            role: role.to_owned(),
        };
        self.auth.user_grant_role(request).await.map(drop)
    }

    /// Add role `name`.
    pub async fn role_add(&mut self, name: &str) -> Result<(), Status> {
        let request = AuthRoleAddRequest {
            name: name.to_owned(),
        };
        self.auth.role_add(request).await.map(drop)
    }

    /// Let role `role` have `access` to every key under `prefix`.
    pub async fn role_grant_prefix(
        &mut self,
        role: &str,
        prefix: &str,
        access: Access,
    ) -> Result<(), Status> {
        let perm_type = match access {
            Access::Read => permission::Type::Read,
            Access::ReadWrite => permission::Type::Readwrite,
        };
        let request = AuthRoleGrantPermissionRequest {
            name: role.to_owned(),
            perm: Some(Permission {
                perm_type: perm_type as i32,
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_end(prefix.as_bytes()),
            }),
        };
        self.auth.role_grant_permission(request).await.map(drop)
    }

    /// Turn authentication on.
    pub async fn auth_enable(&mut self) -> Result<(), Status> {
        self.auth.auth_enable(AuthEnableRequest {}).await.map(drop)
    }
}

/// The end of the range of keys under `prefix` (the prefix with its last byte below 0xff
/// incremented).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let last = prefix
        .iter()
        .rposition(|&b| b < 0xff)
        .expect("a prefix with a byte below 0xff");
    let mut end = prefix[..=last].to_vec();
    end[last] += 1;
    end
}
