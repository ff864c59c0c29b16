//! Tenant isolation: which tenants of a VIP are at their session cap, and which hold more
//! than their weighted share of a busy or full pool.
//!
//! The data plane refuses a new session of a flagged tenant (`TENANT_F_CAPPED`,
//! `TENANT_F_OVER_SHARE`) and applies each tenant's rate itself; this module sets the flags
//! once per step from the connection table's session counts (open flows: ones their client
//! has closed do not count). A tenant is capped while its sessions on the VIP reach its
//! `max_sessions` (0 = no cap). Its share is the VIP's sessions times its weight over the
//! weights of the VIP's tenants that hold sessions or tried to open one since the last step:
//! a tenant with no traffic does not reserve room. While the VIP's pool is all full (every
//! healthy backend of positive weight is full, [`super::admission`]), every tenant over its
//! share is over share. Before that, once the VIP's sessions fill
//! `policy.tenant_busy_fraction` of its backends' session caps, a tenant over its share is
//! over share while it presses its limits: a burst that its own rate and cap already refuse
//! is held to its share of what the pool serves, so it does not fill the engines' batches
//! the others' sessions share, while a tenant within its limits is never refused for where
//! its sessions happen to lie. With room below that, no tenant is over share. While some
//! tenant of a pool is over share, class shedding does not tighten: the tenants furthest
//! over their share are shed first, and a quiet tenant under its share keeps being
//! admitted.

use std::{collections::BTreeMap, time::Duration};

use lb_common::{TENANT_F_CAPPED, TENANT_F_OVER_SHARE};
use serde::Serialize;

/// One tenant on one VIP at a step.
#[derive(Clone, Copy, Debug)]
pub struct TenantInput<'a> {
    pub vip: &'a str,
    pub tenant: &'a str,
    /// The tenant's weight on this VIP (1..=1000).
    pub weight: u32,
    /// 0 = no cap.
    pub max_sessions: u32,
    /// Its clients' active sessions on the VIP (the connection table's flows).
    pub sessions: u64,
    /// Cumulative new sessions the data plane admitted for it on the VIP.
    pub admitted: u64,
    /// Cumulative new sessions the data plane refused for it on the VIP (every reason).
    pub refused: u64,
}

/// What a tenant's limits decide on one VIP at a step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TenantDecision {
    pub vip: String,
    pub tenant: String,
    pub sessions: u64,
    /// At its `max_sessions`: new sessions are refused.
    pub capped: bool,
    /// Over its share of a busy or full pool: new sessions are refused.
    pub over_share: bool,
    /// Its share of the VIP's sessions while the pool is busy or full; `None` while it has
    /// plenty of room.
    pub share: Option<f64>,
    /// New sessions admitted per second since the previous step.
    pub admitted_per_sec: f64,
}

impl TenantDecision {
    /// `TenantLimits::flags` for the data plane.
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.capped {
            f |= TENANT_F_CAPPED;
        }
        if self.over_share {
            f |= TENANT_F_OVER_SHARE;
        }
        f
    }
}

/// The counters of each (VIP, tenant) at the previous step, for attempts and rates.
#[derive(Default)]
pub(super) struct Memory {
    last: BTreeMap<(String, String), (Duration, u64, u64)>,
}

/// A tenant's new-session attempts since the previous step and its admitted rate.
#[derive(Clone, Copy)]
pub(super) struct Activity {
    attempts: u64,
    admitted_per_sec: f64,
    /// Its limits refused at least as many of its new sessions as they admitted since the
    /// previous step (and at least one): it offers twice what they let through.
    pressing: bool,
}

impl Memory {
    /// Each input's activity since the last step (inputs not seen before, or whose counters
    /// went back because their id was reassigned, start from zero); forgets the rest.
    pub(super) fn observe(&mut self, now: Duration, inputs: &[TenantInput]) -> Vec<Activity> {
        let mut next = BTreeMap::new();
        let out = inputs
            .iter()
            .map(|t| {
                let key = (t.vip.to_owned(), t.tenant.to_owned());
                let a = match self.last.get(&key) {
                    Some(&(at, admitted, refused))
                        if t.admitted >= admitted && t.refused >= refused =>
                    {
                        let dt = now.saturating_sub(at).as_secs_f64();
                        let (new, no) = (t.admitted - admitted, t.refused - refused);
                        Activity {
                            attempts: new + no,
                            admitted_per_sec: if dt > 0.0 { new as f64 / dt } else { 0.0 },
                            pressing: no >= new.max(1),
                        }
                    }
                    _ => Activity {
                        attempts: 0,
                        admitted_per_sec: 0.0,
                        pressing: false,
                    },
                };
                next.insert(key, (now, t.admitted, t.refused));
                a
            })
            .collect();
        self.last = next;
        out
    }
}

/// How much room a VIP's pool has, as tenants' shares see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// No share applies.
    Plenty,
    /// The VIP's sessions fill `policy.tenant_busy_fraction` of its backends' session caps.
    /// A tenant over its share that presses its limits (refused at least as often as
    /// admitted since the previous step, by its rate, its cap or its share) is refused new
    /// sessions: it stays refused while it keeps trying and is over its share. A tenant
    /// whose limits let most of its sessions through is not, however its sessions lie.
    Busy,
    /// Every healthy backend is full: every tenant over its share is refused.
    Full,
}

/// The room in a VIP's pool, `pool_full` or not, for its `tenants` on backends in rotation
/// with session caps `caps`, busy from `busy_fraction` of their sum. Busy needs every one of
/// them capped: without a cap the pool's room is unknown short of full.
pub(super) fn room(
    pool_full: bool,
    busy_fraction: f64,
    tenants: &[(&TenantInput, Activity)],
    caps: impl Iterator<Item = u32>,
) -> Room {
    let sessions: u64 = tenants.iter().map(|(t, _)| t.sessions).sum();
    let (mut capacity, mut any, mut uncapped) = (0u64, false, false);
    for c in caps {
        any = true;
        uncapped |= c == 0;
        capacity += u64::from(c);
    }
    if pool_full {
        Room::Full
    } else if any && !uncapped && sessions as f64 >= busy_fraction * capacity as f64 {
        Room::Busy
    } else {
        Room::Plenty
    }
}

/// The decisions for one VIP's tenants (`tenants` with their `activity`) with `room` in its
/// pool.
pub(super) fn decide(room: Room, tenants: &[(&TenantInput, Activity)]) -> Vec<TenantDecision> {
    let total: u64 = tenants.iter().map(|(t, _)| t.sessions).sum();
    let active_weight: u64 = tenants
        .iter()
        .filter(|(t, a)| t.sessions > 0 || a.attempts > 0)
        .map(|(t, _)| u64::from(t.weight))
        .sum();
    tenants
        .iter()
        .map(|(t, a)| {
            let share = (room != Room::Plenty && active_weight > 0)
                .then(|| total as f64 * f64::from(t.weight) / active_weight as f64);
            let held = room == Room::Full || a.pressing;
            TenantDecision {
                vip: t.vip.to_owned(),
                tenant: t.tenant.to_owned(),
                sessions: t.sessions,
                capped: t.max_sessions > 0 && t.sessions >= u64::from(t.max_sessions),
                over_share: held && share.is_some_and(|s| t.sessions as f64 > s),
                share,
                admitted_per_sec: a.admitted_per_sec,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn input<'a>(tenant: &'a str, weight: u32, sessions: u64) -> TenantInput<'a> {
        TenantInput {
            vip: "chat",
            tenant,
            weight,
            max_sessions: 0,
            sessions,
            admitted: 0,
            refused: 0,
        }
    }

    fn run(mem: &mut Memory, now: Duration, full: bool, ts: &[TenantInput]) -> Vec<TenantDecision> {
        let act = mem.observe(now, ts);
        let work: Vec<_> = ts.iter().zip(act).collect();
        let room = if full { Room::Full } else { Room::Plenty };
        decide(room, &work)
    }

    #[test]
    fn capped_while_sessions_reach_max_sessions_whether_or_not_the_pool_is_full() {
        let mut mem = Memory::default();
        let mut t = input("acme", 1, 39);
        t.max_sessions = 40;
        assert!(!run(&mut mem, S, false, &[t])[0].capped);
        t.sessions = 40;
        let d = run(&mut mem, 2 * S, false, &[t]);
        assert!(d[0].capped && !d[0].over_share);
        assert_eq!(d[0].flags(), TENANT_F_CAPPED);
        // No cap: never capped.
        let t = input("acme", 1, 1_000_000);
        assert!(!run(&mut mem, 3 * S, true, &[t])[0].capped);
    }

    #[test]
    fn a_quiet_tenant_under_its_share_is_admitted_while_a_noisy_one_over_it_is_flagged() {
        let mut mem = Memory::default();
        // A full pool of 100 sessions: noisy holds 90 at weight 1, quiet 10 at weight 1.
        let ts = [input("noisy", 1, 90), input("quiet", 1, 10)];
        let d = run(&mut mem, S, true, &ts);
        assert!(d[0].over_share, "noisy holds 90 of a 50 share");
        assert_eq!(d[0].flags(), TENANT_F_OVER_SHARE);
        assert_eq!(d[0].share, Some(50.0));
        assert!(
            !d[1].over_share && d[1].flags() == 0,
            "quiet keeps being admitted"
        );
        // Room in the pool: nobody is over share, however the sessions lie.
        let d = run(&mut mem, 2 * S, false, &ts);
        assert!(d.iter().all(|d| !d.over_share && d.share.is_none()));
    }

    #[test]
    fn a_busy_pool_refuses_a_tenant_over_its_share_only_while_it_presses_its_limits() {
        let mut mem = Memory::default();
        let mut busy = |now, ts: &[TenantInput]| {
            let act = mem.observe(now, ts);
            decide(Room::Busy, &ts.iter().zip(act).collect::<Vec<_>>())
        };
        let mut ts = [
            input("noisy", 1, 20),
            input("quiet", 1, 10),
            input("other", 1, 10),
        ];
        // The counters' baseline.
        busy(S, &ts);
        // Noisy's limits refused 5 and admitted 3: it presses them. Quiet holds more than its
        // share (16 of 46 / 3) by chance, its limits refused 1 and admitted 3: not pressing.
        (ts[0].admitted, ts[0].refused) = (3, 5);
        (ts[1].admitted, ts[1].refused, ts[1].sessions) = (3, 1, 16);
        let d = busy(2 * S, &ts);
        assert!(d[0].over_share && d[0].flags() == TENANT_F_OVER_SHARE);
        assert!(
            !d[1].over_share,
            "quiet's limits let most of its sessions through"
        );
        // Flagged, noisy keeps trying: every attempt refused keeps it flagged.
        ts[0].refused = 9;
        assert!(busy(3 * S, &ts)[0].over_share);
        // It stops trying: nothing to hold it to.
        assert!(!busy(4 * S, &ts)[0].over_share);
        // Pressing again but within its share (10 of 36 / 3): admitted.
        (ts[0].sessions, ts[0].refused) = (10, 20);
        assert!(!busy(5 * S, &ts)[0].over_share);
        // The same pressing tenant over its share where the pool has plenty of room.
        (ts[0].sessions, ts[0].refused) = (20, 30);
        let act = mem.observe(6 * S, &ts);
        let d = decide(Room::Plenty, &ts.iter().zip(act).collect::<Vec<_>>());
        assert!(d.iter().all(|d| !d.over_share && d.share.is_none()));
    }

    #[test]
    fn shares_follow_the_weights_of_the_tenants_with_sessions_or_attempts() {
        let mut mem = Memory::default();
        // weight 3 vs 1 of 100 sessions: shares 75 and 25.
        let ts = [
            input("big", 3, 70),
            input("small", 1, 30),
            input("idle", 4, 0),
        ];
        let d = run(&mut mem, S, true, &ts);
        // The idle tenant (no sessions, no attempts) reserves nothing.
        assert_eq!(d[0].share, Some(75.0));
        assert!(!d[0].over_share);
        assert!(d[1].over_share, "30 of a 25 share");
        // The idle tenant starts trying: its weight counts, the others' shares shrink.
        let mut ts2 = ts;
        ts2[2].refused = 5;
        run(&mut mem, 2 * S, true, &ts); // the counters' baseline
        let d = run(&mut mem, 3 * S, true, &ts2);
        assert_eq!(d[0].share, Some(37.5));
        assert!(d[0].over_share && d[1].over_share && !d[2].over_share);
    }

    #[test]
    fn the_admitted_rate_is_per_second_of_the_fake_clock_and_restarts_when_counters_reset() {
        let mut mem = Memory::default();
        let mut t = input("acme", 1, 0);
        t.admitted = 100;
        assert_eq!(run(&mut mem, S, false, &[t])[0].admitted_per_sec, 0.0);
        t.admitted = 160;
        let d = run(&mut mem, 3 * S, false, &[t]);
        assert_eq!(d[0].admitted_per_sec, 30.0);
        // The id was reassigned and its counters zeroed: no negative rate, a new baseline.
        t.admitted = 4;
        assert_eq!(run(&mut mem, 4 * S, false, &[t])[0].admitted_per_sec, 0.0);
        t.admitted = 6;
        assert_eq!(run(&mut mem, 5 * S, false, &[t])[0].admitted_per_sec, 2.0);
    }
}
