//! The service SIGKILLed and started again under the publisher, and what becomes of the
//! published locator.
//!
//! - GPU: the service's fabric handles die with its allocation, so the publisher withdraws
//!   the region (`unpublished R not-shareable`) and node B sees the locator go; a fetch of it
//!   is refused (`Stale { serving: None }`). After the restart the generation comes back from
//!   the keeper, and the service's first fabric attach of it copies it into fresh
//!   fabric-shareable chunks: the publisher publishes it again and node B imports it
//!   ([`Run::expect_fabric_republished_after_restart`]).
//! - Host: the publisher holds the chunks' fds, so the locator stays as it was and node B
//!   imports it during the outage and after the restart.
//!
//! Either way node B's mapping from before the SIGKILL is read again and reported.

use std::time::{Duration, Instant};

use crate::child::Failure;
use crate::region::{Mode, REGION};
use crate::run::Run;

const LINE: Duration = Duration::from_secs(10);

impl Run<'_> {
    pub fn restart(&mut self) -> Result<(), Failure> {
        let kept = self.commits[0].clone();
        let g = kept.generation;
        let killed = Instant::now();
        self.service.kill()?;
        self.publisher()?.expect("service-gone", LINE)?;
        self.timings
            .note("service-gone seen by the publisher", killed.elapsed());
        match self.options.mode {
            Mode::Gpu => {
                self.publisher()?
                    .expect(&format!("unpublished {REGION} not-shareable"), LINE)?;
                self.timings
                    .note("locator withdrawn by the publisher", killed.elapsed());
                self.importer()?.ask("gone 10000", LINE * 2)?;
                self.timings
                    .note("locator gone at node B", killed.elapsed());
                let stale = self.importer()?.ask(&format!("stale {g}"), LINE * 3)?;
                if stale != "stale serving=None" {
                    return Err(format!("the withdrawn locator fetched: {stale}").into());
                }
            }
            Mode::Host => {
                let same = self.importer()?.ask("same", LINE)?;
                if same != "same" {
                    return Err(format!("during the outage the locator is {same}").into());
                }
                self.import(&kept, "during the outage")?;
            }
        }
        let held = self.importer()?.ask("reread", LINE * 3)?;
        println!("finding: node B's mapping of generation {g} after the service's SIGKILL: {held}");

        let restarted = Instant::now();
        let up = self.service.restart()?;
        self.timings.note("vmm-memd up again", up);
        self.publisher()?.expect("reconnected", LINE * 3)?;
        self.timings
            .note("publisher reconnected", restarted.elapsed());
        match self.options.mode {
            Mode::Gpu => self.expect_fabric_republished_after_restart()?,
            Mode::Host => {
                let same = self.importer()?.ask("same", LINE)?;
                if same != "same" {
                    return Err(format!("after the restart the locator is {same}").into());
                }
                self.import(&kept, "after the restart")?;
            }
        }
        let held = self.importer()?.ask("reread", LINE * 3)?;
        println!("finding: node B's mapping of generation {g} after the restart: {held}");
        Ok(())
    }

    /// The restarted service gives fabric handles for the generation its keeper kept (copied
    /// into fabric-shareable chunks): the publisher must publish it again (the same number)
    /// within 10 s of its reconnection (a refusal it reports meanwhile is waited past), and
    /// node B must import it with the same bytes and tensors.
    pub fn expect_fabric_republished_after_restart(&mut self) -> Result<(), Failure> {
        let kept = self.commits[0].clone();
        let g = kept.generation;
        let started = Instant::now();
        let published = format!("published {REGION} {g}");
        let mut said = Vec::new();
        loop {
            let left = (started + LINE).saturating_duration_since(Instant::now());
            let others = [format!("unpublished {REGION} "), format!("failed {REGION}")];
            match self.publisher()?.expect_any(
                &[published.as_str(), others[0].as_str(), others[1].as_str()],
                left,
            ) {
                Ok(line) if line == published => break,
                Ok(line) => said.push(line),
                Err(e) => {
                    return Err(format!(
                        "after the restart the kept generation {g} was not published again ({e}); \
                         the publisher said {said:?}"
                    )
                    .into());
                }
            }
        }
        self.timings
            .note("kept generation published again", started.elapsed());
        self.import(&kept, "after the restart")
    }
}
