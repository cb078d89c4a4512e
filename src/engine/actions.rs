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
pub enum Named {
    Suspend,
    Resume,
    /// Back to an earlier succeeded deploy (lifecycle.md "Rollback").
    Rollback,
}

impl Named {
    /// The action named in a route; `None` for a name berth does not know.
    pub fn from_name(name: &str) -> Option<Named> {
        match name {
            "suspend" => Some(Named::Suspend),
            "resume" => Some(Named::Resume),
            "rollback" => Some(Named::Rollback),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Named::Suspend => "suspend",
            Named::Resume => "resume",
            Named::Rollback => "rollback",
        }
    }
}

/// One entry of a deployment's `actions` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Action {
    pub name: &'static str,
    pub reason: Option<Reason>,
}

/// What the list needs besides the record.
pub struct Facts<'r, S: Fn(&str) -> bool> {
    /// The source of the last successful deploy lists the action for its
    /// method in `describe`.
    pub supported: S,
    /// A retained succeeded deploy build before the deployed one exists
    /// (`Lookup::rollback_target`).
    pub earlier_build: bool,
    /// The rollout of the running build, if it has one.
    pub rollout: Option<&'r Rollout>,
    /// A freeze holds the deployment.
    pub frozen: bool,
}

/// Every action with the first reason that disables it, in lifecycle.md's
/// order of checks.
pub fn list<S: Fn(&str) -> bool>(d: &DeploymentRecord, facts: &Facts<'_, S>) -> Vec<Action> {
    // After a failed or cancelled build the deployment may be in either
    // state: both toggles are accepted and the state reasons are not used.
    let after_failure = matches!(d.state(), DeploymentState::Failed);
    let toggle = |suspends: bool, name: &'static str| {
        let wrong_state = d.suspended == suspends;
        let reason = if d.deployed.is_none() {
            Some(Reason::NotDeployed)
        } else if d.has_pending_build() {
            Some(Reason::BuildPending)
        } else if wrong_state && !after_failure {
            Some(if suspends {
                Reason::AlreadySuspended
            } else {
                Reason::NotSuspended
            })
        } else if !(facts.supported)(name) {
            Some(Reason::UnsupportedByRevision)
        } else if facts.frozen {
            Some(Reason::Frozen)
        } else {
            None
        };
        Action { name, reason }
    };
    let rollback = Action {
        name: Named::Rollback.name(),
        reason: if d.deployed.is_none() {
            Some(Reason::NotDeployed)
        } else if d.has_pending_build() {
            Some(Reason::BuildPending)
        } else if !facts.earlier_build {
            Some(Reason::NoEarlierBuild)
        } else {
            None
        },
    };
    vec![
        Action {
            name: "deploy",
            reason: if d.suspended {
                Some(Reason::Suspended)
            } else {
                facts.frozen.then_some(Reason::Frozen)
            },
        },
        Action {
            name: "delete",
            reason: None,
        },
        toggle(true, Named::Suspend.name()),
        toggle(false, Named::Resume.name()),
        rollback,
        rollout_action(super::rollouts::RolloutAction::Pause, facts),
        rollout_action(super::rollouts::RolloutAction::Resume, facts),
        rollout_action(super::rollouts::RolloutAction::Abort, facts),
    ]
}

/// A rollout action, always listed (rollouts.md).
fn rollout_action<S: Fn(&str) -> bool>(
    a: super::rollouts::RolloutAction,
    facts: &Facts<'_, S>,
) -> Action {
    Action {
        name: a.name(),
        reason: a.disabled(facts.rollout, facts.frozen),
    }
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

/// One call of the generic action route.
#[derive(Debug, Clone)]
pub struct ActionCall {
    pub name: String,
    /// `If-Match`: the revision the caller saw.
    pub if_match: Option<u64>,
    /// A rollback's `build_id`; `None`: the newest earlier succeeded deploy.
    pub target: Option<BuildId>,
}

impl Engine {
    /// Suspend or resume (a deploy of the last successful configuration and
    /// source with the new `suspended` value, stored at once), or rollback
    /// (a deploy of an earlier build's snapshot, which becomes the
    /// deployment's configuration and source).
    pub async fn act(
        self: &Arc<Self>,
        id: &str,
        call: ActionCall,
        record: Record<ActionQueued>,
    ) -> Result<ActionQueued, Refusal> {
        let Some(named) = Named::from_name(&call.name) else {
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
                    let ok = described.supports(named.name(), &dep.method);
                    (Some(dep.snapshot.source.digest.clone()), ok)
                }
                None => (None, false),
            };
            let hub = self.hub.clone();
            let id = id.to_string();
            let record = record.clone();
            let call = call.clone();
            let acted = self
                .store
                .write(move |tx| {
                    let checked = Checked {
                        named,
                        described_digest: digest.clone(),
                        supported,
                    };
                    act_tx(tx, &hub, &id, &call, &checked, &record)
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

/// What `act` learned before its write job: the action, and whether the
/// deployed source (as described) supports it.
pub struct Checked {
    pub named: Named,
    pub described_digest: Option<String>,
    pub supported: bool,
}

/// Why the action may not run now: a bad rollback target, or the first
/// reason the `actions` list shows (the list and the route never disagree).
fn refusal(
    tx: &Tx,
    d: &DeploymentRecord,
    call: &ActionCall,
    checked: &Checked,
    earlier_build: bool,
) -> StoreResult<Option<Refusal>> {
    let named = checked.named;
    // A named target is judged before the list: one answer for every bad
    // target (lifecycle.md), whatever the default target would be.
    if let (Named::Rollback, Some(target)) = (named, call.target) {
        if !tx.is_rollback_target(d, target)? {
            return Ok(Some(Refusal::ActionRefused(Reason::RollbackTargetInvalid)));
        }
    }
    let rollout = match d.running {
        Some(b) => tx.rollout(b)?,
        None => None,
    };
    let held = super::freeze::holding(tx, &d.id, now_millis())?;
    let facts = Facts {
        supported: |name: &str| name == named.name() && checked.supported,
        earlier_build,
        rollout: rollout.as_ref().map(|r| &r.rollout),
        frozen: held.is_some(),
    };
    let action = list(d, &facts).into_iter().find(|a| a.name == named.name());
    Ok(action
        .and_then(|a| a.reason)
        .map(|reason| super::freeze::action_refusal(reason, &held)))
}

/// The action's write job (it may run again alone; see `Store::write`).
pub fn act_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    id: &str,
    call: &ActionCall,
    checked: &Checked,
    record: &Record<ActionQueued>,
) -> StoreResult<Acted> {
    let named = checked.named;
    let Some(mut d) = tx.deployment(id)? else {
        return Ok(Acted::Refused(Refusal::NotFound(Missing::Deployment)));
    };
    if call.if_match.is_some_and(|r| r != d.revision) {
        return Ok(Acted::Refused(Refusal::PreconditionFailed));
    }
    let deployed_digest = d
        .deployed
        .as_ref()
        .map(|x| x.snapshot.source.digest.clone());
    if deployed_digest != checked.described_digest {
        return Ok(Acted::DescribeAgain);
    }
    let earlier = tx.rollback_target(&d)?;
    if let Some(refusal) = refusal(tx, &d, call, checked, earlier.is_some())? {
        return Ok(Acted::Refused(refusal));
    }
    let Some(deployed) = d.deployed.clone() else {
        return Ok(Acted::Refused(Refusal::ActionRefused(Reason::NotDeployed)));
    };
    let change = Change::new(tx, hub);
    let new = match named {
        Named::Suspend | Named::Resume => {
            d.suspended = named == Named::Suspend;
            NewBuild {
                kind: BuildKind::Deploy,
                trigger: Trigger::Action(named.name().to_string()),
                suspended: d.suspended,
                method: deployed.method,
                snapshot: deployed.snapshot,
                rollback_of: None,
            }
        }
        Named::Rollback => match rollback_of(tx, &mut d, call.target.or(earlier))? {
            Ok(new) => new,
            Err(reason) => return Ok(Acted::Refused(Refusal::ActionRefused(reason))),
        },
    };
    let held_back = (named == Named::Rollback)
        .then(|| deployed_source(&d))
        .flatten();
    let build = change.enqueue(&mut d, new)?;
    if let Some(from) = held_back {
        super::transition::hold_back(&change, &d, from, build.id, "action:rollback")?;
    }
    let queued = ActionQueued { build_id: build.id };
    record.store(&change, &queued)?;
    Ok(Acted::Done(queued))
}

/// The rollback build to `target` (the named one, else the default), or
/// why there is none.
fn rollback_of(
    tx: &Tx,
    d: &mut DeploymentRecord,
    target: Option<BuildId>,
) -> StoreResult<Result<NewBuild, Reason>> {
    let Some(target) = target else {
        return Ok(Err(Reason::NoEarlierBuild));
    };
    let new = super::transition::rollback_build(tx, d, target, Trigger::Action("rollback".into()))?;
    Ok(new.ok_or(Reason::RollbackTargetInvalid))
}

/// The deployed source, when it differs from the configuration's source now
/// set on `d` (a rollback that changes the source holds the one it left).
fn deployed_source(d: &DeploymentRecord) -> Option<Source> {
    let deployed = d.deployed.as_ref()?;
    (deployed.snapshot.source != d.snapshot.source).then(|| deployed.snapshot.source.clone())
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
                nodes: vec![],
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
            auto_rollback: true,
        }
    }

    fn reasons(d: &DeploymentRecord, supported: bool) -> Vec<(&'static str, Option<&'static str>)> {
        let facts = Facts {
            supported: |_: &str| supported,
            earlier_build: true,
            rollout: None,
            frozen: false,
        };
        list(d, &facts)
            .into_iter()
            .filter(|a| !a.name.starts_with("rollout_"))
            .map(|a| (a.name, a.reason.map(Reason::code)))
            .collect()
    }

    #[test]
    fn rollout_actions_are_always_listed_with_their_reasons() {
        use crate::rollout::{plan, Event, Policy, Staging};
        let reasons = |r: Option<&Rollout>| -> Vec<(&str, Option<&str>)> {
            let facts = Facts {
                supported: |_: &str| true,
                earlier_build: true,
                rollout: r,
                frozen: false,
            };
            list(&deployment(), &facts)
                .into_iter()
                .filter(|a| a.name.starts_with("rollout_"))
                .map(|a| (a.name, a.reason.map(Reason::code)))
                .collect()
        };
        let none = Some("no_rollout");
        assert_eq!(
            reasons(None),
            [
                ("rollout_pause", none),
                ("rollout_resume", none),
                ("rollout_abort", none)
            ]
        );
        let policy = Policy::default();
        let nodes = vec!["web".to_string()];
        let running = Rollout::new(
            plan(&nodes, &policy, Staging::Staged),
            &policy,
            Staging::Staged,
        );
        assert_eq!(
            reasons(Some(&running)),
            [
                ("rollout_pause", None),
                ("rollout_resume", Some("not_paused")),
                ("rollout_abort", None)
            ]
        );
        let paused = running.apply(&Event::PauseAsked, 0, false).expect("fits");
        assert_eq!(
            reasons(Some(&paused))[0],
            ("rollout_pause", Some("already_paused"))
        );
        assert_eq!(reasons(Some(&paused))[1], ("rollout_resume", None));
        let aborting = running.apply(&Event::AbortAsked, 0, false).expect("fits");
        assert_eq!(reasons(Some(&aborting))[2], ("rollout_abort", none));
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
                ("resume", Some("not_suspended")),
                ("rollback", None)
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
                ("resume", None),
                ("rollback", None)
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
        // Rollback: deployed, nothing pending, an earlier build.
        assert_eq!(reasons(&never, true)[4], ("rollback", Some("not_deployed")));
        assert_eq!(
            reasons(&pending, true)[4],
            ("rollback", Some("build_pending"))
        );
        let alone = Facts {
            supported: |_: &str| true,
            earlier_build: false,
            rollout: None,
            frozen: false,
        };
        assert_eq!(
            list(&active, &alone)[4].reason.map(Reason::code),
            Some("no_earlier_build")
        );
    }
}
