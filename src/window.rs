//! PURE: maintenance window arithmetic (spec lifecycle.md "Maintenance
//! window arithmetic"). `(window, instant) -> open window or next opening`,
//! no I/O, no clock: the caller passes the instant.
//!
//! A window opens at the local `start` in its time zone on each matching day
//! and stays open `duration` of real (UTC) time:
//! - monthly on a day the month lacks opens on the month's last day;
//! - a start that a DST change skips opens late by the length of the gap
//!   (02:30 on Amsterdam's spring-forward night opens at 03:30);
//! - a start that occurs twice (autumn) opens at the first occurrence;
//! - a window that opened yesterday and is still open counts.
//!
//! All zone arithmetic lives here so the zone crate can be swapped: it is
//! time-tz 3 (its 2.0 release bundles 2022 zone data).

use time::{Date, Duration, Month, OffsetDateTime, PrimitiveDateTime, Time, UtcOffset};
use time_tz::{Offset, OffsetError, PrimitiveDateTimeExt, TimeZone, Tz};

use crate::model::{Frequency, UpdatePolicy};

/// Longest window (lifecycle.md): 24 hours.
pub const MAX_DURATION_MINUTES: u32 = 1440;
/// Longest weekly or monthly freeze window (rollouts.md "Freeze"): a week,
/// so a weekend fits.
pub const MAX_FREEZE_DURATION_MINUTES: u32 = 10_080;
/// Shortest window: three ticks of the longest `--update-interval`.
pub const MIN_DURATION_MINUTES: u32 = 15;
/// Local days searched for the next opening: a monthly window opens at
/// least once in any 31 + 31 days; one more day covers a skipped date.
const SEARCH_DAYS: i64 = 63;

/// Longest zone name accepted (the longest IANA name is 32 bytes).
pub const MAX_ZONE_NAME: usize = 64;

/// A zone of the built-in database by its IANA name, links included
/// (`UTC`, `Asia/Calcutta`). The crate also maps Windows names ("W. Europe
/// Standard Time"); those are refused by shape: the contract says IANA.
pub fn zone(name: &str) -> Option<&'static Tz> {
    let iana_shape = !name.is_empty()
        && name.len() <= MAX_ZONE_NAME
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_+-/".contains(&c));
    iana_shape
        .then(|| time_tz::timezones::get_by_name(name))
        .flatten()
}

/// `HH:MM` as a local time of day.
pub fn parse_start(text: &str) -> Option<Time> {
    let (h, m) = text.split_once(':')?;
    if h.len() != 2 || m.len() != 2 || !h.bytes().chain(m.bytes()).all(|c| c.is_ascii_digit()) {
        return None;
    }
    Time::from_hms(h.parse().ok()?, m.parse().ok()?, 0).ok()
}

/// One window policy, checked and resolved.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub frequency: Frequency,
    /// 1-7 (Monday = 1) for weekly, 1-31 for monthly, ignored for daily.
    pub day: u8,
    pub start: Time,
    pub duration: Duration,
    pub zone: &'static Tz,
}

/// Where an instant stands against a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowState {
    /// Open since `opened` (UTC), closes at `closes`.
    Open {
        opened: OffsetDateTime,
        closes: OffsetDateTime,
    },
    /// Closed; opens next at `next` (UTC), `None` if not within the search.
    Closed { next: Option<OffsetDateTime> },
}

/// Which field of a window policy breaks a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidPolicy {
    /// `day`: absent for daily, 1-7 for weekly, 1-31 for monthly.
    Day,
    /// `start`: a local `HH:MM`.
    Start,
    /// `duration_minutes`: 15 to 1440.
    Duration,
    /// `time_zone`: not an IANA name of the built-in database.
    TimeZone,
}

impl Window {
    /// The window of a policy: `None` for `manual` and `automatic`.
    pub fn from_policy(policy: &UpdatePolicy) -> Result<Option<Window>, InvalidPolicy> {
        let UpdatePolicy::Window {
            frequency,
            day,
            start,
            duration_minutes,
            time_zone,
        } = policy
        else {
            return Ok(None);
        };
        Window::checked(
            *frequency,
            *day,
            start,
            *duration_minutes,
            time_zone,
            MAX_DURATION_MINUTES,
        )
        .map(Some)
    }

    /// A freeze's window (rollouts.md "Freeze"): a policy window's rules,
    /// but a weekly or monthly one may last up to a week.
    pub fn for_freeze(
        frequency: Frequency,
        day: Option<u8>,
        start: &str,
        duration_minutes: u32,
        time_zone: &str,
    ) -> Result<Window, InvalidPolicy> {
        let max = match frequency {
            Frequency::Daily => MAX_DURATION_MINUTES,
            Frequency::Weekly | Frequency::Monthly => MAX_FREEZE_DURATION_MINUTES,
        };
        Window::checked(frequency, day, start, duration_minutes, time_zone, max)
    }

    fn checked(
        frequency: Frequency,
        day: Option<u8>,
        start: &str,
        duration_minutes: u32,
        time_zone: &str,
        max_minutes: u32,
    ) -> Result<Window, InvalidPolicy> {
        let day = match (frequency, day) {
            (Frequency::Daily, None) => 0,
            (Frequency::Weekly, Some(d @ 1..=7)) => d,
            (Frequency::Monthly, Some(d @ 1..=31)) => d,
            _ => return Err(InvalidPolicy::Day),
        };
        let start = parse_start(start).ok_or(InvalidPolicy::Start)?;
        if !(MIN_DURATION_MINUTES..=max_minutes).contains(&duration_minutes) {
            return Err(InvalidPolicy::Duration);
        }
        let zone = zone(time_zone).ok_or(InvalidPolicy::TimeZone)?;
        Ok(Window {
            frequency,
            day,
            start,
            duration: Duration::minutes(i64::from(duration_minutes)),
            zone,
        })
    }

    /// Whether a window opens on the local date `date`.
    fn opens_on(&self, date: Date) -> bool {
        match self.frequency {
            Frequency::Daily => true,
            Frequency::Weekly => date.weekday().number_from_monday() == self.day,
            Frequency::Monthly => {
                let last = time::util::days_in_month(date.month(), date.year());
                date.day() == self.day.min(last)
            }
        }
    }

    /// The instant the window of local date `date` opens.
    fn opening(&self, date: Date) -> OffsetDateTime {
        local_to_instant(PrimitiveDateTime::new(date, self.start), self.zone)
    }

    /// Where `now` stands: open (with the opening and closing instants) or
    /// closed (with the next opening).
    pub fn state(&self, now: OffsetDateTime) -> WindowState {
        let now = now.to_offset(UtcOffset::UTC);
        let today = now
            .to_offset(self.zone.get_offset_utc(&now).to_utc())
            .date();
        // A window open now opened at most its duration ago: on one of the
        // last local dates that covers (a day's window: the last two, or
        // today); the latest opening wins.
        let mut open = None;
        for back in (0..=self.duration.whole_days() + 2).rev() {
            let Some(date) = today.checked_sub(Duration::days(back)) else {
                continue;
            };
            if !self.opens_on(date) {
                continue;
            }
            let opened = self.opening(date);
            let closes = opened + self.duration;
            if opened <= now && now < closes {
                open = Some(WindowState::Open { opened, closes });
            }
        }
        if let Some(open) = open {
            return open;
        }
        let mut date = today.checked_sub(Duration::days(1));
        for _ in 0..SEARCH_DAYS {
            let Some(d) = date else { break };
            if self.opens_on(d) {
                let opening = self.opening(d);
                if opening > now {
                    return WindowState::Closed {
                        next: Some(opening),
                    };
                }
            }
            date = d.next_day();
        }
        WindowState::Closed { next: None }
    }

    pub fn is_open(&self, now: OffsetDateTime) -> bool {
        matches!(self.state(now), WindowState::Open { .. })
    }
}

/// A local time in `zone` as an instant. In a gap (the clock jumps over
/// it) the time is read with the offset in force before the jump, which
/// lands as late after the jump as the gap is long; in a fold (the clock
/// repeats it) the first occurrence wins.
pub fn local_to_instant(local: PrimitiveDateTime, zone: &Tz) -> OffsetDateTime {
    match local.assume_timezone(zone) {
        Ok(t) => t,
        Err(OffsetError::Ambiguous(first, _)) => first,
        Err(OffsetError::Undefined) => {
            // The offset a day before is the one in force before the jump
            // (transitions are months apart; Apia's skipped day is 24 h).
            let before = local.assume_utc() - Duration::hours(36);
            let offset = zone.get_offset_utc(&before).to_utc();
            local.assume_offset(offset)
        }
    }
}

/// The date of `year-month-day`, or the month's last day when it lacks one.
pub fn clamp_date(year: i32, month: Month, day: u8) -> Option<Date> {
    let last = time::util::days_in_month(month, year);
    Date::from_calendar_date(year, month, day.min(last)).ok()
}

#[cfg(test)]
mod tests;
