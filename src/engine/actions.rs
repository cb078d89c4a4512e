//! Actions (spec lifecycle.md "Actions"): the list every read shows, each
//! action enabled or with the first reason that disables it, and the one
//! generic procedure behind `POST /v1/deployments/{id}/actions/{name}`
//! (today `suspend` and `resume`). The list is computed by one pure
//! function, so the read and the route can never disagree.

use std::sync::Arc;

use super::audit::{Audited, Record};
use super::refusal::{ActionReason as Reason, Missing, Refusal};
use super::transition::{Change, NewBuild};
use super::Engine;
use crate::events::Hub;
use crate::model::*;
use crate::store::{Lookup, StoreResult, Tx};

/// An action the generic route runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toggle {
    Suspend,
    Resume,
}

impl Toggle {
    /// The action named in a route; `None` for a name berth does not know.
    pub fn from_name(name: &str) -> Option<Toggle> {
        match name {
            "suspend" => Some(Toggle::Suspend),
            "resume" => Some(Toggle::Resume),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Toggle::Suspend => "suspend",
            Toggle::Resume => "resume",
        }
    }

    /// The `suspended` flag after the action.
    fn suspends(self) -> bool {
        self == Toggle::Suspend
    }
}

/// One entry of a deployment's `actions` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Action {
    pub name: &'static str,
    pub reason: Option<Reason>,
}

/// Every action with the first reason that disables it, in lifecycle.md's
/// order of checks. `supported(name)`: the source of the last successful
/// deploy lists the action for its method in `describe`.
pub fn list(d: &DeploymentRecord, supported: impl Fn(&str) -> bool) -> Vec<Action> {
    // After a failed or cancelled build the deployment may be in either
    // state: both toggles are accepted and the state reasons are not used.
    let after_failure = matches!(d.state(), DeploymentState::Failed);
    let toggle = |t: Toggle| {
        let wrong_state = d.suspended == t.suspends();
        let reason = if d.deployed.is_none() {
            Some(Reason::NotDeployed)
        } else if d.has_pending_build() {
            Some(Reason::BuildPending)
        } else if wrong_state && !after_failure {
            Some(match t {
                Toggle::Suspend => Reason::AlreadySuspended,
                Toggle::Resume => Reason::NotSuspended,
            })
        } else if !supported(t.name()) {
            Some(Reason::UnsupportedByRevision)
        } else {
            None
        };
        Action {
            name: t.name(),
            reason,
        }
    };
    vec![
        Action {
            name: "deploy",
            reason: d.suspended.then_some(Reason::Suspended),
        },
        Action {
            name: "delete",
            reason: None,
        },
        toggle(Toggle::Suspend),
        toggle(Toggle::Resume),
    ]
}

/// An action that was taken: the queued deploy build.
#[derive(Debug)]
pub struct ActionQueued {
    pub build_id: BuildId,
}

impl Audited for ActionQueued {
    fn audited_build(&self) -> Option<BuildId> {
        Some(self.build_id)
    }
}

/// What the action's write job found.
pub enum Acted {
    Done(ActionQueued),
    Refused(Refusal),
    /// The deployed source changed since its `describe` was read: read it
    /// again and retry.
    DescribeAgain,
}

impl Engine {
    /// Suspend or resume: queues a deploy of the last successful
    /// configuration and source with the new `suspended` value, which is
    /// stored at once. `if_match`: the revision the caller saw.
    pub async fn act(
        self: &Arc<Self>,
        id: &str,
        name: &str,
        if_match: Option<u64>,
        record: Record<ActionQueued>,
    ) -> Result<ActionQueued, Refusal> {
        let Some(toggle) = Toggle::from_name(name) else {
            return Err(Refusal::NotFound(Missing::Action));
        };
        // The deployed source can change between its describe and the
        // write job only when a build finishes in between; twice is plenty.
        let record = Arc::new(record);
        for _ in 0..2 {
            let d = self
                .store
                .read()?
                .deployment(id)?
                .ok_or(Refusal::NotFound(Missing::Deployment))?;
            let (digest, supported) = match &d.deployed {
                Some(dep) => {
                    let described = self.describe(&dep.snapshot.source).await?;
                    let ok = described.supports(toggle.name(), &dep.method);
                    (Some(dep.snapshot.source.digest.clone()), ok)
                }
                None => (None, false),
            };
            let hub = self.hub.clone();
            let id = id.to_string();
            let record = record.clone();
            let acted = self
                .store
                .write(move |tx| {
                    act_tx(
                        tx,
                        &hub,
                        &id,
                        toggle,
                        if_match,
                        digest.clone(),
                        supported,
                        &record,
                    )
                })
                .await?;
            match acted {
                Acted::Done(queued) => {
                    self.wake_queue();
                    return Ok(queued);
                }
                Acted::Refused(refusal) => return Err(refusal),
                Acted::DescribeAgain => {}
            }
        }
        Err(Refusal::Internal)
    }
}

/// The action's write job (it may run again alone; see `Store::write`).
/// retry needs it).
#[allow(clippy::too_many_arguments)]
pub fn act_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    id: &str,
    toggle: Toggle,
    if_match: Option<u64>,
    described_digest: Option<String>,
    supported: bool,
    record: &Record<ActionQueued>,
) -> StoreResult<Acted> {
    let Some(mut d) = tx.deployment(id)? else {
        return Ok(Acted::Refused(Refusal::NotFound(Missing::Deployment)));
    };
    if if_match.is_some_and(|r| r != d.revision) {
        return Ok(Acted::Refused(Refusal::PreconditionFailed));
    }
    let deployed_digest = d
        .deployed
        .as_ref()
        .map(|x| x.snapshot.source.digest.clone());
    if deployed_digest != described_digest {
        return Ok(Acted::DescribeAgain);
    }
    let action = list(&d, |name| name == toggle.name() && supported)
        .into_iter()
        .find(|a| a.name == toggle.name());
    if let Some(reason) = action.and_then(|a| a.reason) {
        return Ok(Acted::Refused(Refusal::ActionRefused(reason)));
    }
    let Some(deployed) = d.deployed.clone() else {
        return Ok(Acted::Refused(Refusal::ActionRefused(Reason::NotDeployed)));
    };
    d.suspended = toggle.suspends();
    let change = Change::new(tx, hub);
    let build = change.enqueue(
        &mut d,
        NewBuild {
            kind: BuildKind::Deploy,
            trigger: Trigger::Action(toggle.name().to_string()),
            suspended: toggle.suspends(),
            method: deployed.method,
            snapshot: deployed.snapshot,
        },
    )?;
    let queued = ActionQueued { build_id: build.id };
    record.store(&change, &queued)?;
    Ok(Acted::Done(queued))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment() -> DeploymentRecord {
        let snapshot = Snapshot {
            configuration: "{}".into(),
            source: Source {
                url: "u".into(),
                rev: "r".into(),
                digest: "d".into(),
            },
        };
        DeploymentRecord {
            id: "d".into(),
            revision: 3,
            suspended: false,
            method: "m".into(),
            domain: None,
            snapshot: snapshot.clone(),
            update_policy: UpdatePolicy::Manual,
            deployed: Some(Deployed {
                build_id: 1,
                snapshot,
                method: "m".into(),
                finished_at: 1,
            }),
            last_build: Some(1),
            last_finished: Some(LastFinished {
                build_id: 1,
                kind: BuildKind::Deploy,
                status: BuildStatus::Succeeded,
            }),
            pending_deploys: 0,
            pending_destroys: 0,
            running: None,
            event_seq: 2,
            created_at: 1,
            updated_at: 1,
        }
    }

    fn reasons(d: &DeploymentRecord, supported: bool) -> Vec<(&'static str, Option<&'static str>)> {
        list(d, |_| supported)
            .into_iter()
            .map(|a| (a.name, a.reason.map(Reason::code)))
            .collect()
    }

    #[test]
    fn every_reason_in_its_order_of_checks() {
        let active = deployment();
        assert_eq!(
            reasons(&active, true),
            [
                ("deploy", None),
                ("delete", None),
                ("suspend", None),
                ("resume", Some("not_suspended"))
            ]
        );
        assert_eq!(
            reasons(&active, false)[2],
            ("suspend", Some("unsupported_by_revision"))
        );
        // The state reason comes before the support reason.
        assert_eq!(
            reasons(&active, false)[3],
            ("resume", Some("not_suspended"))
        );

        let mut suspended = deployment();
        suspended.suspended = true;
        assert_eq!(
            reasons(&suspended, true),
            [
                ("deploy", Some("suspended")),
                ("delete", None),
                ("suspend", Some("already_suspended")),
                ("resume", None)
            ]
        );

        let mut pending = deployment();
        pending.pending_deploys = 1;
        assert_eq!(
            reasons(&pending, false)[2],
            ("suspend", Some("build_pending"))
        );
        assert_eq!(
            reasons(&pending, false)[3],
            ("resume", Some("build_pending"))
        );

        let mut never = deployment();
        never.deployed = None;
        never.pending_deploys = 1;
        assert_eq!(reasons(&never, true)[2], ("suspend", Some("not_deployed")));
        assert_eq!(reasons(&never, true)[3], ("resume", Some("not_deployed")));

        // After a failed build both toggles are accepted.
        let mut failed = deployment();
        failed.last_finished = Some(LastFinished {
            build_id: 2,
            kind: BuildKind::Deploy,
            status: BuildStatus::Failed,
        });
        assert_eq!(reasons(&failed, true)[2], ("suspend", None));
        assert_eq!(reasons(&failed, true)[3], ("resume", None));
        assert_eq!(
            reasons(&failed, false)[3],
            ("resume", Some("unsupported_by_revision"))
        );
    }
}
