//! Fd-carrying messages: SCM_RIGHTS over `SOCK_SEQPACKET`, serde with fds out of band, [`Queue`].

mod oob;

pub use oob::{
    Encoded, Fd, decode, deserialize_error, deserialize_fd, encode, serialize_error, serialize_fd,
    serialize_owned_fd,
};
