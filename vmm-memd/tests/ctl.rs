//! `vmm-memctl`: usage and exit codes, status/list/metrics as text and JSON that change
//! nothing in the service, delete for whom the ACL lets delete, metrics in the Prometheus
//! text format, sleep and wake (their output and exit statuses; the semantics and the other
//! uid's refusals are in `admin_sleep.rs`).

mod common;

use std::process::{Output, Stdio};

use common::{NOBODY, ServiceProc, is_root, program, program_as_nobody, publish};
use vmm_memd::protocol::Status;

fn memctl(socket: &str, args: &[&str], nobody: bool) -> Output {
    let mut command = match nobody {
        true => program_as_nobody("vmm-memctl"),
        false => program("vmm-memctl"),
    };
    command
        .args(["--socket", socket])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn help_usage_errors_and_no_service_have_their_exit_codes() {
    let out = memctl("@vmm-memctl-test-nothing-here", &["--help"], false);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).starts_with("usage: vmm-memctl"));
    for bad in [
        &[][..],
        &["frobnicate"],
        &["status", "--frob"],
        &["delete"],
        &["list", "x"],
        &["sleep"],
        &["wake"],
        &["sleep", "a", "b"],
    ] {
        let out = memctl("@x", bad, false);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).starts_with("vmm-memctl: "));
        assert!(out.stdout.is_empty());
    }
    let out = memctl("@vmm-memctl-test-nothing-here", &["status"], false);
    assert_eq!(out.status.code(), Some(3), "no service: {out:?}");
}

#[test]
fn reading_commands_show_regions_readers_and_quota_and_change_nothing() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 2, 1 << 20);
    publish(&client, "weights", 2, 1 << 20);
    let reader = service.connect();
    let attached = reader.attach("weights").unwrap();
    let before = client.status().unwrap();
    let mut outputs = Vec::new();
    for args in [
        &["status"][..],
        &["list"],
        &["metrics"],
        &["--json", "status"],
        &["--json", "list"],
        &["--json", "metrics"],
    ] {
        let out = memctl(&service.socket, args, false);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        outputs.push(stdout(&out));
    }
    assert_eq!(
        client.status().unwrap(),
        before,
        "a reading command changed the service"
    );
    // Text.
    assert!(
        outputs[0].contains("generation 2 (current): 2097152 bytes, 1 leases"),
        "{}",
        outputs[0]
    );
    assert!(outputs[0].contains(&format!("readers [{}]", std::process::id())));
    assert!(
        outputs[0].contains("2097152 of 1073741824 bytes used"),
        "{}",
        outputs[0]
    );
    assert_eq!(outputs[1], "weights\t2\t2097152\tawake\n");
    // JSON: the same status the client library reads.
    let status: Status = serde_json::from_str(&outputs[3]).unwrap();
    assert_eq!(status, before);
    let list: serde_json::Value = serde_json::from_str(&outputs[4]).unwrap();
    assert_eq!(list[0]["region"], "weights");
    assert_eq!(list[0]["generation"], 2);
    let metrics: serde_json::Value = serde_json::from_str(&outputs[5]).unwrap();
    assert_eq!(metrics["metrics"].as_str().unwrap(), outputs[2]);
    drop(attached);
}

#[test]
fn metrics_are_prometheus_text() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 4096);
    let _lease = client.attach("weights").unwrap();
    let _ = client.attach("nothing-here");
    let text = client.metrics().unwrap();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            assert!(rest.starts_with("HELP vmm_memd_") || rest.starts_with("TYPE vmm_memd_"));
            continue;
        }
        let (name, value) = line.rsplit_once(' ').expect(line);
        assert!(name.starts_with("vmm_memd_"), "{line}");
        value.parse::<u64>().expect(line);
    }
    for wanted in [
        "vmm_memd_region_generation{region=\"weights\"} 1",
        "vmm_memd_region_bytes{region=\"weights\"} 4096",
        "vmm_memd_region_leases{region=\"weights\"} 1",
        "vmm_memd_quota_used_bytes{uid=\"",
        "vmm_memd_refusals_total 1",
        "# TYPE vmm_memd_refusals_total counter",
    ] {
        assert!(text.contains(wanted), "{wanted} in\n{text}");
    }
}

#[test]
fn delete_is_for_whom_the_acl_lets_delete() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let acl = vmm_memd::protocol::Acl {
        read: vec![vmm_memd::protocol::Principal::Uid(NOBODY)],
        ..Default::default()
    };
    let writer = client
        .begin(
            "weights",
            &[4096],
            vmm_memd::BeginOptions {
                acl,
                ..Default::default()
            },
        )
        .unwrap();
    writer.commit().unwrap();
    if is_root() {
        let out = memctl(&service.socket, &["--json", "delete", "weights"], true);
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let refused: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(
            refused["refused"]["AccessDenied"]["right"], "Delete",
            "{refused}"
        );
        assert_eq!(client.list().unwrap().len(), 1);
    } else {
        println!("SKIP the other uid's delete: needs root for setpriv");
    }
    let out = memctl(&service.socket, &["delete", "weights"], false);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(client.list().unwrap().is_empty());
    let out = memctl(&service.socket, &["delete", "weights"], false);
    assert_eq!(out.status.code(), Some(1), "nothing to delete");
}

#[test]
fn sleep_and_wake_say_what_they_did_with_their_exit_statuses() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "kv", 1, 4096);
    let reader = service.connect();
    let attached = reader.attach("kv").unwrap();
    let run = |args: &[&str]| memctl(&service.socket, args, false);

    // A reader holds it: falling asleep.
    let out = run(&["sleep", "kv"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        stdout(&out),
        "kv generation 1 falling asleep: memory freed once 1 leases end\n"
    );
    assert!(stdout(&run(&["list"])).ends_with("\tfalling asleep\n"));
    reader.detach(&attached).unwrap();
    let status = stdout(&run(&["status"]));
    assert!(
        status.contains("generation 1 (current, asleep): 4096 bytes, 0 leases"),
        "{status}"
    );
    assert_eq!(stdout(&run(&["list"])), "kv\t1\t4096\tasleep\n");
    let out = run(&["--json", "sleep", "kv"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({"slept": "kv", "generation": 1, "leases": 0})
    );
    let json_status: Status = serde_json::from_str(&stdout(&run(&["--json", "status"]))).unwrap();
    assert_eq!(
        json_status.regions[0].generations[0].sleep,
        vmm_memd::protocol::SleepState::Asleep
    );

    let out = run(&["wake", "kv"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(stdout(&out), "kv generation 1 awake: zeroed\n");
    // Awake: refused (exit 1), with the refusal in JSON.
    let out = run(&["--json", "wake", "kv"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let refused: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(refused["refused"]["InvalidRequest"]["rule"], "NotAsleep");
    // No such region: exit 1; no service: exit 3.
    assert_eq!(run(&["sleep", "nothing-here"]).status.code(), Some(1));
    let out = memctl("@vmm-memctl-test-nothing-here", &["wake", "kv"], false);
    assert_eq!(out.status.code(), Some(3));
    let help = stdout(&memctl("@x", &["--help"], false));
    assert!(help.contains("sleep REGION") && help.contains("wake REGION"));
}
