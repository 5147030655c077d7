//! Idempotent commits (issue 34, item 4): a writer names its generation with a token of its
//! choosing, and after a commit whose reply it lost learns whether that generation landed
//! (from a new connection, after the service's SIGKILL and restart too), instead of publishing
//! it twice or not at all.

mod common;

use std::time::Duration;

use common::{ServiceProc, publish, until};
use vmm_memd::protocol::{CommitState, Request, Response};
use vmm_memd::{BeginOptions, MemdError, Refusal, RequestRule, commit_token};

fn tokened(token: [u8; 16]) -> BeginOptions {
    BeginOptions {
        token: Some(token),
        ..Default::default()
    }
}

fn current(client: &vmm_memd::Client, region: &str) -> u64 {
    let list = client.list().unwrap();
    list.iter().find(|r| r.region == region).unwrap().generation
}

/// The state once the writer's connection has ended (`Pending` until the service has seen it
/// end).
fn settled(client: &vmm_memd::Client, region: &str, token: [u8; 16]) -> CommitState {
    let mut state = CommitState::Pending;
    until(Duration::from_secs(5), || {
        state = client.commit_state(region, token).unwrap();
        state != CommitState::Pending
    });
    state
}

#[test]
fn a_commit_whose_reply_was_lost_is_known_to_have_landed() {
    let service = ServiceProc::start(&[]);
    let reader = service.connect();
    publish(&reader, "weights", 1, 4096);
    let token = commit_token().unwrap();
    // The writer's exchange by hand, so that the commit's reply can be lost: Begin (the
    // chunk's fd dropped unmapped), Token, Commit sent, and the connection dropped before
    // the reply is read.
    let writer = service.connect();
    writer.set_keep_alive(false);
    let send = |request: &Request| postcard::to_allocvec(request).unwrap();
    let begin = Request::Begin {
        region: "weights".into(),
        chunks: vec![4096],
        acl: Default::default(),
        wait_ms: 0,
    };
    let Response::Began { generation, .. } = writer.request_raw(&send(&begin)).unwrap() else {
        panic!("not Began");
    };
    drop(writer.session().recv_message().unwrap());
    assert_eq!(
        writer
            .request_raw(&send(&Request::Token { token }))
            .unwrap(),
        Response::Done
    );
    writer.session().send_data(&send(&Request::Commit)).unwrap();
    drop(writer);
    assert_eq!(
        settled(&reader, "weights", token),
        CommitState::Landed { generation }
    );
    assert_eq!(current(&reader, "weights"), generation);
    // A commit that did land is known as long as the region remembers it: a later
    // generation does not change the answer.
    publish(&reader, "weights", 1, 4096);
    assert_eq!(
        reader.commit_state("weights", token).unwrap(),
        CommitState::Landed { generation }
    );
}

#[test]
fn a_writer_that_died_before_its_commit_learns_that_nothing_landed() {
    let service = ServiceProc::start(&[]);
    let reader = service.connect();
    let first = publish(&reader, "weights", 1, 4096);
    let token = commit_token().unwrap();
    let writer = service.connect();
    let w = writer.begin("weights", &[4096], tokened(token)).unwrap();
    assert_eq!(
        reader.commit_state("weights", token).unwrap(),
        CommitState::Pending,
        "its writer's connection is open"
    );
    std::mem::forget(w);
    drop(writer);
    assert_eq!(settled(&reader, "weights", token), CommitState::Unknown);
    assert_eq!(current(&reader, "weights"), first, "nothing landed");
    // The writer publishes again under a new token, exactly once.
    let again = commit_token().unwrap();
    let w = reader.begin("weights", &[4096], tokened(again)).unwrap();
    let generation = w.commit().unwrap();
    assert_eq!(
        reader.commit_state("weights", again).unwrap(),
        CommitState::Landed { generation }
    );
}

#[test]
fn a_token_the_region_knows_is_refused_and_its_generation_aborted() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let token = commit_token().unwrap();
    let landed = client
        .begin("weights", &[4096], tokened(token))
        .unwrap()
        .commit()
        .unwrap();
    let refused = client.begin("weights", &[4096], tokened(token));
    assert!(
        matches!(
            refused,
            Err(MemdError::Refused(Refusal::InvalidRequest {
                rule: RequestRule::Token,
                ..
            }))
        ),
        "{refused:?}"
    );
    // The refused generation was aborted: the connection may begin again, and the token
    // still names the first.
    let next = client
        .begin("weights", &[4096], Default::default())
        .unwrap();
    assert_eq!(next.commit().unwrap(), landed + 1);
    assert_eq!(
        client.commit_state("weights", token).unwrap(),
        CommitState::Landed { generation: landed }
    );
    assert_eq!(
        client.commit_state("weights", [0; 16]).unwrap(),
        CommitState::Unknown
    );
    assert!(matches!(
        client.commit_state("nothing", token),
        Err(MemdError::Refused(Refusal::NoSuchRegion { .. }))
    ));
}

#[test]
fn a_landed_token_is_known_after_the_services_sigkill_and_restart() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    let token = commit_token().unwrap();
    let generation = client
        .begin("weights", &[4096], tokened(token))
        .unwrap()
        .commit()
        .unwrap();
    drop(client);
    service.signal(libc::SIGKILL);
    service.child.wait().unwrap();
    service.restart();
    let client = service.connect();
    assert_eq!(
        client.commit_state("weights", token).unwrap(),
        CommitState::Landed { generation },
        "the keeper kept the token with the generation"
    );
}
