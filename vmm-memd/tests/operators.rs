//! The operator role (issue 34 item 2): the service's admins (`--admin-uid`, `--admin-gid`;
//! root when none is named) list, delete, sleep and wake any region, change any region's ACL
//! and set any uid's quota at run time, through `vmm-memctl`; what they set is kept across a
//! restart; everyone else is refused with a typed error; an admin still cannot read a
//! region's memory it has no right to. The other uid is 65534, through `setpriv` (root
//! needed: SKIP otherwise).

mod common;

use std::process::Output;

use common::{NOBODY, Role, ServiceProc, is_root, program, program_as_nobody, role_args, say};
use vmm_memd::protocol::{Acl, Principal};
use vmm_memd::{BeginOptions, MemdError, Refusal};

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    let client = common::role_client();
    match role.as_str() {
        // Publish ARGS[0] (one 4 KiB chunk), owned by this process's uid.
        "publish" => {
            let generation = common::publish(&client, &args[0], 1, 4096);
            say(&format!("PUBLISHED {generation}"));
        }
        // Begin ARGS[0] with one chunk of ARGS[1] bytes: BEGAN, or the refusal's kind.
        "begin" => {
            let bytes: u64 = args[1].parse().unwrap();
            match client.begin(&args[0], &[bytes], BeginOptions::default()) {
                Ok(writer) => {
                    drop(writer);
                    say("BEGAN");
                }
                Err(MemdError::Refused(r)) => say(r.kind()),
                Err(e) => say(&format!("ERROR {e:?}")),
            }
        }
        // Attach ARGS[0]: ATTACHED, or the refusal's kind.
        "attach" => match client.attach(&args[0]) {
            Ok(a) => say(&format!("ATTACHED {}", a.generation)),
            Err(MemdError::Refused(r)) => say(r.kind()),
            Err(e) => say(&format!("ERROR {e:?}")),
        },
        other => panic!("unknown role {other}"),
    }
}

fn memctl(service: &ServiceProc, args: &[&str]) -> Output {
    program("vmm-memctl")
        .args(["--socket", &service.socket, "--json"])
        .args(args)
        .output()
        .unwrap()
}

fn memctl_as_nobody(service: &ServiceProc, args: &[&str]) -> Output {
    program_as_nobody("vmm-memctl")
        .args(["--socket", &service.socket, "--json"])
        .args(args)
        .output()
        .unwrap()
}

/// The refusal a `vmm-memctl --json` that exited 1 printed: its variant and fields.
fn refusal(out: &Output) -> (String, serde_json::Value) {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (kind, fields) = doc["refused"].as_object().unwrap().iter().next().unwrap();
    (kind.clone(), fields.clone())
}

fn ok(out: Output) -> serde_json::Value {
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// uid 65534 publishes a region that names no one else; root, the default admin, sees it in
/// list and status, sleeps and wakes it, gives it an ACL, and deletes it, and still cannot
/// attach it. uid 65534 is refused each operator request with a typed error.
#[test]
fn an_admin_operates_any_region_and_no_one_else_may() {
    if !is_root() {
        println!("SKIP an_admin_operates_any_region_and_no_one_else_may: needs root (setpriv)");
        return;
    }
    let service = ServiceProc::start(&[]);
    let mut owner = Role::spawn("publish", &service, &["theirs"], true);
    assert_eq!(owner.expect_line(), "PUBLISHED 1");
    let root = service.connect();
    // Seen by the admin, though no ACL names it.
    assert!(root.list().unwrap().iter().any(|r| r.region == "theirs"));
    let status = root.status().unwrap();
    let theirs = status
        .regions
        .iter()
        .find(|r| r.region == "theirs")
        .unwrap();
    assert_eq!(theirs.owner, NOBODY);
    // Seen, not read: the admin has no right to the memory.
    let err = root.attach("theirs").unwrap_err();
    assert!(
        matches!(err, MemdError::Refused(Refusal::NoSuchRegion { .. })),
        "{err:?}"
    );
    // Sleep and wake through vmm-memctl.
    let slept = ok(memctl(&service, &["sleep", "theirs"]));
    assert_eq!(slept["generation"], 1);
    let woke = ok(memctl(&service, &["wake", "theirs"]));
    assert_eq!(woke["zeroed"], true);
    // uid 65534 may not set quotas or release everything (typed), nor see root's region.
    root.begin("mine", &[4096], BeginOptions::default())
        .unwrap()
        .commit()
        .unwrap();
    let (kind, fields) = refusal(&memctl_as_nobody(&service, &["quota", "0", "1"]));
    assert_eq!(
        (kind.as_str(), &fields["uid"]),
        ("NotAdmin", &NOBODY.into())
    );
    let (kind, _) = refusal(&memctl_as_nobody(&service, &["release", "--all"]));
    assert_eq!(kind, "NotAdmin");
    let (kind, _) = refusal(&memctl_as_nobody(
        &service,
        &["acl", "mine", "--read", "uid:65534"],
    ));
    assert_eq!(kind, "NoSuchRegion", "root's region does not exist for it");
    // Root gives "mine" a read ACL for uid 65534: it now sees and reads it, and still may
    // not change its ACL (it does not own it).
    ok(memctl(&service, &["acl", "mine", "--read", "uid:65534"]));
    let mut reader = Role::spawn("attach", &service, &["mine"], true);
    assert_eq!(reader.expect_line(), "ATTACHED 1");
    let (kind, _) = refusal(&memctl_as_nobody(&service, &["acl", "mine"]));
    assert_eq!(kind, "NotAdmin");
    // The owner changes its own region's ACL (gives root read), without being an admin.
    let out = memctl_as_nobody(&service, &["acl", "theirs", "--read", "uid:0"]);
    ok(out);
    assert_eq!(root.attach("theirs").unwrap().generation, 1);
    // And the admin deletes a region it does not own.
    ok(memctl(&service, &["delete", "theirs"]));
    assert!(!root.list().unwrap().iter().any(|r| r.region == "theirs"));
    // A usage error: an ACL entry that is neither uid:N nor gid:N.
    let out = memctl(&service, &["acl", "mine", "--read", "user:1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// A quota and an ACL an admin set at run time hold after a graceful stop and a start, and
/// after a SIGKILL and a start (the keeper holds them); `quota UID default` gives the
/// command line's quota back.
#[test]
fn quotas_and_acls_set_at_run_time_are_kept_across_restarts() {
    if !is_root() {
        println!("SKIP quotas_and_acls_set_at_run_time_are_kept_across_restarts: needs root");
        return;
    }
    let mut service = ServiceProc::start(&[]);
    let root = service.connect();
    root.begin("shared", &[4096], BeginOptions::default())
        .unwrap()
        .commit()
        .unwrap();
    ok(memctl(&service, &["quota", &NOBODY.to_string(), "8192"]));
    ok(memctl(&service, &["acl", "shared", "--read", "uid:65534"]));
    let begin = |service: &ServiceProc, bytes: &str| {
        let mut writer = Role::spawn("begin", service, &["nobodys", bytes], true);
        writer.expect_line()
    };
    assert_eq!(begin(&service, "16384"), "QuotaExceeded");
    assert_eq!(begin(&service, "4096"), "BEGAN");
    drop(root);
    for how in [libc::SIGTERM, libc::SIGKILL] {
        service.signal(how);
        service.child.wait().unwrap();
        service.restart();
        assert_eq!(begin(&service, "16384"), "QuotaExceeded", "signal {how}");
        assert_eq!(begin(&service, "4096"), "BEGAN", "signal {how}");
        let mut reader = Role::spawn("attach", &service, &["shared"], true);
        assert_eq!(reader.expect_line(), "ATTACHED 1", "signal {how}");
    }
    // The command line's quota (1 GiB) again, kept across a restart too.
    ok(memctl(&service, &["quota", &NOBODY.to_string(), "default"]));
    service.signal(libc::SIGTERM);
    service.child.wait().unwrap();
    service.restart();
    assert_eq!(begin(&service, "16384"), "BEGAN");
    // An ACL set through the client (an empty one: the owner alone) is kept as well.
    service
        .connect()
        .set_acl("shared", &Acl::default())
        .unwrap();
    service.signal(libc::SIGTERM);
    service.child.wait().unwrap();
    service.restart();
    let mut reader = Role::spawn("attach", &service, &["shared"], true);
    assert_eq!(reader.expect_line(), "NoSuchRegion");
    // A reader's ACL entry by group works the same way (uid 65534's primary gid).
    let acl = Acl {
        read: vec![Principal::Gid(NOBODY)],
        ..Acl::default()
    };
    service.connect().set_acl("shared", &acl).unwrap();
    let mut reader = Role::spawn("attach", &service, &["shared"], true);
    assert_eq!(reader.expect_line(), "ATTACHED 1");
}

/// An admin named by a group: the members of `--admin-gid` are admins, and so a uid that is
/// no admin by itself may set quotas once its group is named.
#[test]
fn the_members_of_an_admin_gid_are_admins() {
    if !is_root() {
        println!("SKIP the_members_of_an_admin_gid_are_admins: needs root (setpriv)");
        return;
    }
    // uid 65534 runs with its primary gid 65534 (and no supplementary groups).
    let service = ServiceProc::start(&["--admin-gid", &NOBODY.to_string()]);
    ok(memctl_as_nobody(&service, &["quota", "1000", "4096"]));
    // Root is no admin now (an admin was named): it is refused.
    let (kind, fields) = refusal(&memctl(&service, &["quota", "1000", "4096"]));
    assert_eq!((kind.as_str(), &fields["uid"]), ("NotAdmin", &0.into()));
}

/// Extreme values an operator may send: a quota of 0 refuses every byte, one of `u64::MAX`
/// refuses none, one past `u64::MAX` is a usage error; an ACL of more entries than a list may
/// hold is refused, typed, and changes nothing.
#[test]
fn extreme_quotas_and_an_oversized_acl() {
    if !is_root() {
        println!("SKIP extreme_quotas_and_an_oversized_acl: needs root (setpriv)");
        return;
    }
    let service = ServiceProc::start(&[]);
    let nobody = NOBODY.to_string();
    let begin = |bytes: &str| {
        let mut writer = Role::spawn("begin", &service, &["nobodys", bytes], true);
        writer.expect_line()
    };
    ok(memctl(&service, &["quota", &nobody, "0"]));
    assert_eq!(begin("1"), "QuotaExceeded");
    ok(memctl(&service, &["quota", &nobody, &u64::MAX.to_string()]));
    assert_eq!(begin("4096"), "BEGAN");
    let past = (u128::from(u64::MAX) + 1).to_string();
    let out = memctl(&service, &["quota", &nobody, &past]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let root = service.connect();
    root.begin("mine", &[4096], BeginOptions::default())
        .unwrap()
        .commit()
        .unwrap();
    let mut args = vec!["acl".to_owned(), "mine".to_owned()];
    for uid in 0..=vmm_memd::protocol::MAX_ACL_ENTRIES as u32 {
        args.extend(["--read".to_owned(), format!("uid:{uid}")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (kind, fields) = refusal(&memctl(&service, &args));
    assert_eq!(kind, "InvalidRequest", "{fields}");
    assert_eq!(fields["rule"], "Acl", "{fields}");
    let mut reader = Role::spawn("attach", &service, &["mine"], true);
    assert_eq!(
        reader.expect_line(),
        "NoSuchRegion",
        "the ACL did not change"
    );
}
