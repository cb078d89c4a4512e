//! The window function with fixed instants in real zones, every rule of
//! lifecycle.md, and a property over random windows and instants.

use proptest::prelude::*;
use time::macros::{datetime, time};

use super::*;

fn window(frequency: Frequency, day: u8, start: Time, minutes: i64, zone_name: &str) -> Window {
    Window {
        frequency,
        day,
        start,
        duration: Duration::minutes(minutes),
        zone: zone(zone_name).expect("a zone of the database"),
    }
}

fn daily(start: Time, minutes: i64, zone_name: &str) -> Window {
    window(Frequency::Daily, 0, start, minutes, zone_name)
}

fn next(w: &Window, now: OffsetDateTime) -> OffsetDateTime {
    match w.state(now) {
        WindowState::Closed { next: Some(next) } => next,
        other => panic!("expected closed with a next opening at {now}, got {other:?}"),
    }
}

fn opened(w: &Window, now: OffsetDateTime) -> OffsetDateTime {
    match w.state(now) {
        WindowState::Open { opened, .. } => opened,
        other => panic!("expected open at {now}, got {other:?}"),
    }
}

#[test]
fn zones_are_iana_names_of_the_database() {
    assert!(zone("Europe/Amsterdam").is_some());
    assert!(zone("Australia/Lord_Howe").is_some());
    assert!(zone("Mars/Olympus_Mons").is_none());
    assert!(zone("europe/amsterdam").is_none());
    assert!(zone("").is_none());
    assert!(zone("UTC").is_some(), "a link is an IANA name too");
    assert!(zone("W. Europe Standard Time").is_none(), "a Windows name");
}

#[test]
fn policies_are_checked_field_by_field() {
    let policy = |frequency, day, start: &str, minutes, tz: &str| UpdatePolicy::Window {
        frequency,
        day,
        start: start.into(),
        duration_minutes: minutes,
        time_zone: tz.into(),
    };
    assert!(Window::from_policy(&UpdatePolicy::Manual)
        .unwrap()
        .is_none());
    assert!(Window::from_policy(&UpdatePolicy::Automatic)
        .unwrap()
        .is_none());
    let ok = policy(Frequency::Weekly, Some(7), "03:00", 120, "Europe/Amsterdam");
    assert!(Window::from_policy(&ok).unwrap().is_some());
    let cases = [
        (
            policy(Frequency::Daily, Some(1), "03:00", 60, "UTC"),
            InvalidPolicy::Day,
        ),
        (
            policy(Frequency::Weekly, Some(8), "03:00", 60, "UTC"),
            InvalidPolicy::Day,
        ),
        (
            policy(Frequency::Weekly, None, "03:00", 60, "UTC"),
            InvalidPolicy::Day,
        ),
        (
            policy(Frequency::Monthly, Some(32), "03:00", 60, "UTC"),
            InvalidPolicy::Day,
        ),
        (
            policy(Frequency::Monthly, Some(0), "03:00", 60, "UTC"),
            InvalidPolicy::Day,
        ),
        (
            policy(Frequency::Daily, None, "3:00", 60, "UTC"),
            InvalidPolicy::Start,
        ),
        (
            policy(Frequency::Daily, None, "03:00", 14, "UTC"),
            InvalidPolicy::Duration,
        ),
        (
            policy(Frequency::Daily, None, "03:00", 1441, "UTC"),
            InvalidPolicy::Duration,
        ),
        (
            policy(Frequency::Daily, None, "03:00", 60, "Europe/Atlantis"),
            InvalidPolicy::TimeZone,
        ),
    ];
    for (p, expected) in cases {
        assert_eq!(Window::from_policy(&p).err(), Some(expected), "{p:?}");
    }
}

#[test]
fn start_times_are_hh_mm() {
    assert_eq!(parse_start("03:00"), Some(time!(03:00)));
    assert_eq!(parse_start("23:59"), Some(time!(23:59)));
    for bad in [
        "24:00", "3:00", "03:60", "0300", "03:00:00", "aa:bb", "", "-1:00",
    ] {
        assert_eq!(parse_start(bad), None, "{bad}");
    }
}

#[test]
fn amsterdam_spring_forward_opens_late_by_the_gap() {
    // 2026-03-29 02:00 +01:00 jumps to 03:00 +02:00: 02:30 does not exist.
    let w = daily(time!(02:30), 60, "Europe/Amsterdam");
    let night = datetime!(2026-03-29 00:00 UTC);
    assert_eq!(next(&w, night), datetime!(2026-03-29 03:30 +02:00));
    assert_eq!(
        opened(&w, datetime!(2026-03-29 01:30 UTC)),
        datetime!(2026-03-29 01:30 UTC)
    );
    assert!(!w.is_open(datetime!(2026-03-29 01:29:59 UTC)));
    assert!(
        !w.is_open(datetime!(2026-03-29 02:30 UTC)),
        "closed after its hour"
    );
    // The night before and after: the ordinary local time.
    assert_eq!(
        next(&w, datetime!(2026-03-27 12:00 UTC)),
        datetime!(2026-03-28 02:30 +01:00)
    );
    assert_eq!(
        next(&w, datetime!(2026-03-29 12:00 UTC)),
        datetime!(2026-03-30 02:30 +02:00)
    );
}

#[test]
fn amsterdam_autumn_fold_opens_at_the_first_occurrence() {
    // 2026-10-25 03:00 +02:00 goes back to 02:00 +01:00: 02:30 happens twice.
    let w = daily(time!(02:30), 30, "Europe/Amsterdam");
    assert_eq!(
        next(&w, datetime!(2026-10-24 23:00 UTC)),
        datetime!(2026-10-25 02:30 +02:00)
    );
    assert!(w.is_open(datetime!(2026-10-25 00:45 UTC)));
    // The second 02:30 (01:30 UTC) is not a new opening.
    assert!(!w.is_open(datetime!(2026-10-25 01:30 UTC)));
}

#[test]
fn new_york_spring_forward() {
    // 2026-03-08 02:00 EST jumps to 03:00 EDT.
    let w = daily(time!(02:30), 60, "America/New_York");
    assert_eq!(
        next(&w, datetime!(2026-03-08 05:00 UTC)),
        datetime!(2026-03-08 03:30 -04:00)
    );
    assert_eq!(
        next(&w, datetime!(2026-03-08 09:00 UTC)),
        datetime!(2026-03-09 02:30 -04:00)
    );
}

#[test]
fn lord_howe_half_hour_gap() {
    // 2026-10-04 02:00 +10:30 jumps to 02:30 +11:00: 02:15 opens 30 minutes
    // late, at 02:45 local.
    let w = daily(time!(02:15), 60, "Australia/Lord_Howe");
    assert_eq!(
        next(&w, datetime!(2026-10-03 12:00 UTC)),
        datetime!(2026-10-04 02:45 +11:00)
    );
    assert_eq!(
        next(&w, datetime!(2026-10-03 12:00 UTC)),
        datetime!(2026-10-03 15:45 UTC)
    );
}

#[test]
fn kolkata_has_no_dst() {
    let w = daily(time!(03:00), 120, "Asia/Kolkata");
    assert_eq!(
        next(&w, datetime!(2026-06-01 00:00 UTC)),
        datetime!(2026-06-01 21:30 UTC)
    );
    assert_eq!(
        next(&w, datetime!(2026-12-01 00:00 UTC)),
        datetime!(2026-12-01 21:30 UTC)
    );
}

/// Apia skipped 2011-12-30: 2011-12-29 24:00 (-10:00) was followed by
/// 2011-12-31 00:00 (+14:00). The skipped day's 03:00 falls in that 24-hour
/// gap and opens 24 hours late, which is the same instant as 2011-12-31
/// 03:00: one opening, no panic, no loop.
#[test]
fn apia_skipped_a_whole_day() {
    let w = daily(time!(03:00), 60, "Pacific/Apia");
    assert_eq!(
        next(&w, datetime!(2011-12-29 12:00 UTC)),
        datetime!(2011-12-29 03:00 -10:00)
    );
    let after = next(&w, datetime!(2011-12-29 14:00 UTC));
    assert_eq!(after, datetime!(2011-12-31 03:00 +14:00));
    assert_eq!(after, datetime!(2011-12-30 13:00 UTC));
    assert_eq!(opened(&w, after), after);
    assert_eq!(
        next(&w, after + Duration::hours(2)),
        datetime!(2012-01-01 03:00 +14:00)
    );
}

#[test]
fn a_window_that_opened_yesterday_is_still_open() {
    let w = daily(time!(23:00), 180, "UTC");
    assert_eq!(
        opened(&w, datetime!(2026-05-02 01:00 UTC)),
        datetime!(2026-05-01 23:00 UTC)
    );
    assert!(!w.is_open(datetime!(2026-05-02 02:00 UTC)));
    // Weekly on Friday: open past midnight into Saturday.
    let w = window(Frequency::Weekly, 5, time!(23:00), 180, "UTC");
    assert!(
        w.is_open(datetime!(2026-05-02 01:00 UTC)),
        "2026-05-01 is a Friday"
    );
    assert!(!w.is_open(datetime!(2026-05-03 01:00 UTC)));
}

#[test]
fn monthly_on_a_missing_day_opens_on_the_last_day() {
    let w = window(Frequency::Monthly, 31, time!(04:00), 60, "UTC");
    assert_eq!(
        next(&w, datetime!(2026-04-01 00:00 UTC)),
        datetime!(2026-04-30 04:00 UTC)
    );
    assert_eq!(
        next(&w, datetime!(2027-02-01 00:00 UTC)),
        datetime!(2027-02-28 04:00 UTC)
    );
    // Leap year.
    assert_eq!(
        next(&w, datetime!(2028-02-01 00:00 UTC)),
        datetime!(2028-02-29 04:00 UTC)
    );
    let w = window(Frequency::Monthly, 29, time!(04:00), 60, "UTC");
    assert_eq!(
        next(&w, datetime!(2027-02-01 00:00 UTC)),
        datetime!(2027-02-28 04:00 UTC)
    );
    assert_eq!(
        next(&w, datetime!(2028-02-01 00:00 UTC)),
        datetime!(2028-02-29 04:00 UTC)
    );
    assert_eq!(
        next(&w, datetime!(2028-03-01 00:00 UTC)),
        datetime!(2028-03-29 04:00 UTC)
    );
}

#[test]
fn windows_across_month_and_year_ends() {
    let w = window(Frequency::Monthly, 31, time!(23:30), 60, "UTC");
    assert_eq!(
        opened(&w, datetime!(2027-01-01 00:10 UTC)),
        datetime!(2026-12-31 23:30 UTC)
    );
    assert!(!w.is_open(datetime!(2027-01-01 00:30 UTC)));
    assert_eq!(
        next(&w, datetime!(2027-01-01 00:30 UTC)),
        datetime!(2027-01-31 23:30 UTC)
    );
    // Weekly, from a Sunday to the Monday of the next year.
    let w = window(Frequency::Weekly, 1, time!(03:00), 60, "Europe/Amsterdam");
    assert_eq!(
        next(&w, datetime!(2028-12-31 12:00 UTC)),
        datetime!(2029-01-01 03:00 +01:00)
    );
}

#[test]
fn utc_daily_boundaries() {
    let w = daily(time!(00:00), 15, "UTC");
    assert_eq!(
        opened(&w, datetime!(2026-01-01 00:00 UTC)),
        datetime!(2026-01-01 00:00 UTC)
    );
    assert!(
        !w.is_open(datetime!(2026-01-01 00:15 UTC)),
        "closed at opening + duration"
    );
    assert_eq!(
        next(&w, datetime!(2026-01-01 00:15 UTC)),
        datetime!(2026-01-02 00:00 UTC)
    );
}

const ZONES: [&str; 8] = [
    "Europe/Amsterdam",
    "America/New_York",
    "Australia/Lord_Howe",
    "Asia/Kolkata",
    "Pacific/Apia",
    "UTC",
    "Pacific/Chatham",
    "America/Sao_Paulo",
];

fn arb_window() -> impl Strategy<Value = Window> {
    (
        0usize..3,
        1u8..=31,
        0u8..24,
        0u8..60,
        15i64..=1440,
        0..ZONES.len(),
    )
        .prop_map(|(f, day, h, m, minutes, z)| {
            let frequency = [Frequency::Daily, Frequency::Weekly, Frequency::Monthly][f];
            let day = match frequency {
                Frequency::Weekly => (day - 1) % 7 + 1,
                _ => day,
            };
            window(
                frequency,
                day,
                Time::from_hms(h, m, 0).unwrap(),
                minutes,
                ZONES[z],
            )
        })
}

proptest! {
    /// For random windows and instants across 2020-2040: the next opening
    /// is open at its instant and that window is closed at opening +
    /// duration; an open window contains the instant.
    #[test]
    fn a_window_is_open_at_its_opening_and_closed_at_its_end(
        w in arb_window(),
        seconds in datetime!(2020-01-01 00:00 UTC).unix_timestamp()..datetime!(2040-12-31 00:00 UTC).unix_timestamp(),
    ) {
        let now = OffsetDateTime::from_unix_timestamp(seconds).unwrap();
        match w.state(now) {
            WindowState::Open { opened, closes } => {
                prop_assert!(opened <= now && now < closes);
                prop_assert_eq!(closes - opened, w.duration);
            }
            WindowState::Closed { next } => {
                let next = next.expect("a window opens within the search");
                prop_assert!(next > now);
                prop_assert!(next - now <= Duration::days(63));
                match w.state(next) {
                    WindowState::Open { opened, .. } => prop_assert_eq!(opened, next),
                    other => prop_assert!(false, "closed at its opening: {:?}", other),
                }
                if let WindowState::Open { opened, .. } = w.state(next + w.duration) {
                    prop_assert!(opened != next, "still open at opening + duration");
                }
            }
        }
    }
}
