//! The KV requests the registry builds: a prefix's range end, and the conditional
//! transactions (put or delete a key if a comparison holds).

use vmm_etcd_api::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use vmm_etcd_api::etcdserverpb::request_op::Request;
use vmm_etcd_api::etcdserverpb::{Compare, DeleteRangeRequest, PutRequest, RequestOp, TxnRequest};

/// The end of the range of keys that start with `prefix` (etcd's ranges are
/// `[key, range_end)`): the prefix with its last byte below 0xff incremented and what
/// follows dropped; `[0]` (every key from `prefix` on) when every byte is 0xff.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(last) => {
            let mut end = prefix[..=last].to_vec();
            end[last] += 1;
            end
        }
        None => vec![0],
    }
}

/// `key` compares equal on `target` with `value`.
fn equal(key: String, target: CompareTarget, value: TargetUnion) -> Compare {
    Compare {
        result: CompareResult::Equal as i32,
        target: target as i32,
        key: key.into_bytes(),
        range_end: Vec::new(),
        target_union: Some(value),
    }
}

/// `key` was never created, or was deleted since (its create revision is 0).
pub(crate) fn when_absent(key: String) -> Compare {
    equal(key, CompareTarget::Create, TargetUnion::CreateRevision(0))
}

/// `key` is attached to lease `lease` (an absent key compares as lease 0).
pub(crate) fn when_lease(key: String, lease: i64) -> Compare {
    equal(key, CompareTarget::Lease, TargetUnion::Lease(lease))
}

/// If `condition` holds, put `value` at `key` attached to `lease`.
pub(crate) fn put_if(condition: Compare, key: String, value: Vec<u8>, lease: i64) -> TxnRequest {
    let put = PutRequest {
        key: key.into_bytes(),
        value,
        lease,
        ..PutRequest::default()
    };
    TxnRequest {
        compare: vec![condition],
        success: vec![RequestOp {
            request: Some(Request::RequestPut(put)),
        }],
        failure: Vec::new(),
    }
}

/// If `condition` holds, delete `key`.
pub(crate) fn delete_if(condition: Compare, key: String) -> TxnRequest {
    let delete = DeleteRangeRequest {
        key: key.into_bytes(),
        ..DeleteRangeRequest::default()
    };
    TxnRequest {
        compare: vec![condition],
        success: vec![RequestOp {
            request: Some(Request::RequestDeleteRange(delete)),
        }],
        failure: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_at_its_last_byte_plus_one() {
        assert_eq!(prefix_end(b"/vmm/v1/d/exports/"), b"/vmm/v1/d/exports0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), [0]);
        assert_eq!(prefix_end(b""), [0]);
    }
}
