//! Static membership (`static_membership=true`, KIP-345): a restarted
//! member gets its own partitions back and the other members' partitions
//! never move; a second incarnation with the same instance id fences the
//! first, which stops and fails naming the fix, and the two never run a
//! partition's messages at the same time.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyorder_core::{Client, Delivery, HandlerResult, KeySource, Message, Subscription};
use keyorder_kafka::{partition_for, KafkaTransport};
use tokio::time::Instant;

const PARTITIONS: i32 = 4;

fn url(extra: &str) -> String {
    format!(
        "kafka://{}?partitions={PARTITIONS}&fetch_wait_ms=10&static_membership=true{extra}",
        common::brokers()
    )
}

async fn client(extra: &str) -> Client {
    let t = common::connect(&url(extra)).await;
    Client::new(Arc::new(t))
}

/// One key per partition.
fn keys() -> Vec<String> {
    (0..PARTITIONS)
        .map(|p| {
            (0..)
                .map(|i| format!("k-{i}"))
                .find(|k| partition_for(k.as_bytes(), PARTITIONS) == p)
                .unwrap()
        })
        .collect()
}

/// What a handler saw: instance, key, payload, start, end.
#[derive(Clone, Debug)]
struct Run {
    instance: String,
    key: String,
    payload: String,
    token: u64,
    start: Instant,
    end: Instant,
}

type Log = Arc<Mutex<Vec<Run>>>;

struct Member {
    stats: Arc<keyorder_core::Stats>,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<keyorder_core::Result<keyorder_core::RunReport>>,
}

async fn start(client: &Client, category: &str, instance: &str, label: &str, log: &Log, hold: Duration) -> Member {
    start_with(client, category, instance, label, log, hold, common::lease()).await
}

async fn start_with(
    client: &Client,
    category: &str,
    instance: &str,
    label: &str,
    log: &Log,
    hold: Duration,
    lease: keyorder_core::LeaseConfig,
) -> Member {
    let sub: Subscription = client
        .subscribe(category, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id(instance)
        .lease(lease)
        .build()
        .await
        .unwrap();
    let stats = sub.stats();
    let (log, me) = (log.clone(), label.to_owned());
    let handler = move |d: Delivery| {
        let (log, me) = (log.clone(), me.clone());
        async move {
            let start = Instant::now();
            tokio::time::sleep(hold).await;
            log.lock().unwrap().push(Run {
                instance: me,
                key: d.key().map(|k| k.as_str().to_owned()).unwrap_or_default(),
                payload: String::from_utf8_lossy(d.payload()).into_owned(),
                token: d.fencing_token(),
                start,
                end: Instant::now(),
            });
            HandlerResult::Ok(())
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sub.run(handler, async move {
        let _ = stopped.await;
    }));
    Member { stats, stop, run }
}

async fn publish_round(client: &Client, category: &str, round: usize) -> Vec<String> {
    let publisher = client.publisher(category).await.unwrap();
    let mut sent = Vec::new();
    for key in keys() {
        let payload = format!("{key}/{round}");
        publisher
            .publish(Message::new(payload.clone()).with_key(&key).unwrap())
            .await
            .unwrap();
        sent.push(payload);
    }
    sent
}

/// Waits until every payload in `want` was applied.
async fn applied(log: &Log, want: &[String], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    loop {
        let done: HashSet<String> = log.lock().unwrap().iter().map(|r| r.payload.clone()).collect();
        let missing: Vec<&String> = want.iter().filter(|p| !done.contains(*p)).collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {missing:?} not applied within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Who applied each key's payload of `round`.
fn owners(log: &Log, round: usize) -> BTreeMap<String, String> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|r| r.payload.ends_with(&format!("/{round}")))
        .map(|r| (r.key.clone(), r.instance.clone()))
        .collect()
}

/// The fencing token each key's payload of `round` ran under.
fn tokens(log: &Log, round: usize) -> BTreeMap<String, u64> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|r| r.payload.ends_with(&format!("/{round}")))
        .map(|r| (r.key.clone(), r.token))
        .collect()
}

/// Each key's payloads were first applied in publish order, none lost; a
/// payload may run again after a hand-over (at least once), never a
/// later one before an earlier one's first run.
fn assert_in_order(log: &Log) {
    let mut per_key: HashMap<String, Vec<usize>> = HashMap::new();
    for r in log.lock().unwrap().iter() {
        let round: usize = r.payload.rsplit('/').next().unwrap().parse().unwrap();
        per_key.entry(r.key.clone()).or_default().push(round);
    }
    for (key, rounds) in per_key {
        let mut next = 0;
        for r in &rounds {
            assert!(*r <= next, "key {key}: round {r} ran before round {next}: {rounds:?}");
            if *r == next {
                next += 1;
            }
        }
    }
}

/// Member-a's session is much longer than member-b's: its restart's
/// rebalance (the group waits for the old incarnation, which closed
/// without leaving, as a static member does) outlasts member-b's session
/// timeout. Member-b still holds its partitions meanwhile and must not
/// take that for a lost membership: it was, when the round trip that
/// confirms it waited behind its own pending join on the coordinator
/// connection, and each member's replacement restarted the wait for the
/// other (a replace cycle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_static_member_gets_its_partitions_back_and_no_other_moves() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let client = client("").await;
    let category = format!("static-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let log: Log = Arc::default();
    let long = keyorder_core::LeaseConfig {
        ttl: Duration::from_secs(18),
        ..common::lease()
    };
    let a = start_with(&client, &category, "member-a", "member-a", &log, Duration::ZERO, long).await;
    let b = start(&client, &category, "member-b", "member-b", &log, Duration::ZERO).await;

    // Rounds until the split is settled: both members own partitions, and
    // two rounds in a row went to the same owners.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut round = 0;
    let mut last = BTreeMap::new();
    let split = loop {
        let sent = publish_round(&client, &category, round).await;
        applied(&log, &sent, Duration::from_secs(60), "a settling round").await;
        let now = owners(&log, round);
        round += 1;
        let both = now.values().collect::<HashSet<_>>().len() == 2;
        if both && now == last {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "the group never split its partitions between the two members"
        );
        last = now;
    };
    let b_released = b.stats.snapshot().scopes_released;
    let settled_tokens = tokens(&log, round - 1);

    // A closes (drained). Its partitions' next messages wait for it: B,
    // still running, never takes them.
    a.stop.send(()).unwrap();
    a.run.await.unwrap().expect("member-a closes cleanly");
    let sent = publish_round(&client, &category, round).await;
    let b_keys: Vec<String> = split
        .iter()
        .filter(|(_, i)| i.as_str() == "member-b")
        .map(|(k, _)| k.clone())
        .collect();
    let b_sent: Vec<String> = sent
        .iter()
        .filter(|p| b_keys.iter().any(|k| p.starts_with(&format!("{k}/"))))
        .cloned()
        .collect();
    applied(&log, &b_sent, Duration::from_secs(60), "member-b's own partitions").await;

    // A comes back under its instance id and gets exactly its own back.
    let a2 = start_with(&client, &category, "member-a", "member-a", &log, Duration::ZERO, long).await;
    applied(&log, &sent, Duration::from_secs(90), "the round across the restart").await;
    assert_eq!(
        owners(&log, round),
        split,
        "a partition moved across a static member's restart"
    );
    assert_in_order(&log);
    assert_eq!(
        b.stats.snapshot().scopes_released,
        b_released,
        "member-b handed partitions over across member-a's restart"
    );
    // Member-b kept its ownership throughout: a round after the restart
    // runs under the same lease (token), not a new claim after a loss.
    let next = publish_round(&client, &category, round + 1).await;
    applied(&log, &next, Duration::from_secs(90), "the round after the restart").await;
    assert_eq!(owners(&log, round + 1), split, "a partition moved after the restart");
    let after = tokens(&log, round + 1);
    for k in &b_keys {
        assert_eq!(
            after.get(k),
            settled_tokens.get(k),
            "member-b lost and re-claimed a partition across member-a's restart (its token moved)"
        );
    }

    a2.stop.send(()).unwrap();
    b.stop.send(()).unwrap();
    a2.run.await.unwrap().unwrap();
    b.run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_incarnation_fences_the_first_and_they_never_overlap() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let old_client = client("").await;
    let category = format!("static-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let log: Log = Arc::default();
    let hold = Duration::from_millis(300);
    let old = start(&old_client, &category, "member-a", "old", &log, hold).await;
    let sent = publish_round(&old_client, &category, 0).await;
    applied(&log, &sent, Duration::from_secs(60), "the first incarnation's round").await;

    // Messages keep coming while a second incarnation (another process,
    // here another transport) joins under the same instance id.
    let publishing = {
        let (client, category) = (old_client.clone(), category.clone());
        tokio::spawn(async move {
            let mut all = Vec::new();
            for round in 1..=20 {
                all.extend(publish_round(&client, &category, round).await);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            all
        })
    };
    let new_client = client("").await;
    let new = start(&new_client, &category, "member-a", "new", &log, hold).await;

    let all = publishing.await.unwrap();
    applied(&log, &all, Duration::from_secs(120), "every round after the take-over").await;
    assert_in_order(&log);
    // One incarnation goes on, the other stops. On Apache Kafka the broker
    // fences the old one (its subscription fails naming the fix). tansu
    // 0.6 hands both one member id and fences neither: whichever claimed
    // last goes on, the other's claim check drops its partitions and it
    // does not rejoin, so the two do not take turns.
    let last = publish_round(&old_client, &category, 21).await;
    applied(
        &log,
        &last,
        Duration::from_secs(60),
        "a round after the take-over settled",
    )
    .await;
    let runs = log.lock().unwrap().clone();
    let last_round: HashSet<&str> = runs
        .iter()
        .filter(|r| r.payload.ends_with("/21"))
        .map(|r| r.instance.as_str())
        .collect();
    assert_eq!(
        last_round.len(),
        1,
        "both incarnations ran the last round: {last_round:?}"
    );
    let _ = old.stop.send(());
    match tokio::time::timeout(Duration::from_secs(60), old.run).await {
        Ok(Ok(Err(e))) => assert!(e.to_string().contains("instance id"), "the error names the fix: {e}"),
        Ok(Ok(Ok(_))) => {}
        other => panic!("the first incarnation did not stop: {other:?}"),
    }

    // Never two handlers of one key at once, across the incarnations.
    for key in keys() {
        let mut of_key: Vec<&Run> = runs.iter().filter(|r| r.key == key).collect();
        of_key.sort_by_key(|r| r.start);
        for w in of_key.windows(2) {
            assert!(
                w[0].end <= w[1].start,
                "key {key}: {} ({}) overlapped {} ({})",
                w[0].payload,
                w[0].instance,
                w[1].payload,
                w[1].instance
            );
        }
    }
    new.stop.send(()).unwrap();
    new.run.await.unwrap().expect("the second incarnation closes cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_member_needs_its_own_legal_instance_id() {
    let client = client("").await;
    let category = format!("static-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let err = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("pod 7/x")
        .build()
        .await
        .expect_err("an instance id that cannot be a group.instance.id is refused");
    assert!(err.to_string().contains(".instance_id("), "{err}");
    let first = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("pod-7")
        .build()
        .await
        .unwrap();
    let err = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("pod-7")
        .build()
        .await
        .expect_err("a second static member with the same id in one process is refused");
    assert!(err.to_string().contains("its own .instance_id"), "{err}");
    // Another group may use the same instance id.
    client
        .subscribe(&category, "other")
        .ordered_by(KeySource::routing_key())
        .instance_id("pod-7")
        .build()
        .await
        .unwrap();
    drop(first);
    let err = match KafkaTransport::from_url(
        &format!("kafka://{}?rdkafka.group.instance.id=x", common::brokers())
            .parse()
            .unwrap(),
    )
    .await
    {
        Ok(_) => panic!("group.instance.id passed through is refused"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("static_membership=true"), "{err}");
}

/// The environment variable that makes [`static_member_child`] run: the
/// category it joins.
const CHILD_ENV: &str = "KEYORDER_STATIC_CHILD_CATEGORY";

/// Not a test of its own: the process that
/// [`a_stalled_static_member_does_not_take_its_id_back_from_a_newer_incarnation`]
/// stops and continues. It runs member-a and prints each applied payload,
/// then how its run ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_member_child() {
    let Ok(category) = std::env::var(CHILD_ENV) else {
        return;
    };
    use std::io::Write;
    let client = client("").await;
    let sub: Subscription = client
        .subscribe(&category, "g")
        .ordered_by(KeySource::routing_key())
        .instance_id("member-a")
        .lease(common::lease())
        .build()
        .await
        .unwrap();
    let handler = move |d: Delivery| async move {
        let key = d.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "APPLIED {key} {}", String::from_utf8_lossy(d.payload()));
        let _ = out.flush();
        HandlerResult::Ok(())
    };
    // Runs until the subscription ends by itself (or the parent kills it).
    let ended = sub.run(handler, std::future::pending::<()>()).await;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "ENDED {}",
        match ended {
            Ok(_) => "ok".to_owned(),
            Err(e) => format!("error {}", e.to_string().replace('\n', " ")),
        }
    );
    let _ = out.flush();
}

/// A static member stalled (`SIGSTOP`) past its session while a newer
/// incarnation took its instance id over does not rejoin under that id when
/// it continues: the rejoin would take the partitions back from the newer
/// incarnation (on Apache Kafka it fences the newer one; on tansu it claims
/// over it). It fails naming the fix, and the newer incarnation keeps
/// every partition.
// Failed before the fix (the stalled incarnation rejoined and took the
// partitions back): a gap alone cannot tell a take-over from the member's
// own slow rejoin (the restart test above), so a static member's claims
// name its instance id and, before rejoining after a gap, it reads the
// state topic for a newer claim under its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_static_member_does_not_take_its_id_back_from_a_newer_incarnation() {
    use tokio::io::AsyncBufReadExt;
    let client = client("").await;
    let category = format!("static-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let log: Log = Arc::default();
    let ended: Arc<Mutex<Option<String>>> = Arc::default();

    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "static_member_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &category)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap().to_string();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let reader = {
        let (log, ended) = (log.clone(), ended.clone());
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                // libtest's own `test static_member_child ... ` may open
                // the line.
                let line = line
                    .find("APPLIED ")
                    .or(line.find("ENDED "))
                    .map_or(line.as_str(), |i| &line[i..]);
                if let Some(rest) = line.strip_prefix("APPLIED ") {
                    let (key, payload) = rest.split_once(' ').unwrap();
                    let now = Instant::now();
                    log.lock().unwrap().push(Run {
                        instance: "old".into(),
                        key: key.into(),
                        payload: payload.into(),
                        token: 0,
                        start: now,
                        end: now,
                    });
                } else if let Some(rest) = line.strip_prefix("ENDED ") {
                    *ended.lock().unwrap() = Some(rest.to_owned());
                }
            }
        })
    };
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(status.success(), "kill {sig} {pid}");
    };

    let sent = publish_round(&client, &category, 0).await;
    applied(&log, &sent, Duration::from_secs(90), "the first incarnation's round").await;

    // The first incarnation stalls; a newer one takes its instance id over.
    signal("-STOP");
    let stalled = Instant::now();
    let new = start(&client, &category, "member-a", "new", &log, Duration::ZERO).await;
    let sent = publish_round(&client, &category, 1).await;
    applied(
        &log,
        &sent,
        Duration::from_secs(90),
        "the newer incarnation's first round",
    )
    .await;
    // The stall outlasts the session (the lease TTL) before it ends.
    while stalled.elapsed() < common::lease().ttl * 2 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal("-CONT");

    // The stalled one finds the gap and ends, naming the fix; rounds keep
    // coming meanwhile and all go to the newer incarnation.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut round = 2;
    while ended.lock().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the stalled incarnation went on after it continued (it rejoined under the newer one's instance id)"
        );
        let sent = publish_round(&client, &category, round).await;
        round += 1;
        applied(&log, &sent, Duration::from_secs(90), "a round after the stall ended").await;
    }
    let why = ended.lock().unwrap().clone().unwrap();
    eprintln!("the stalled incarnation ended: {why}");
    assert!(
        why.starts_with("error") && why.contains("instance id"),
        "the stalled incarnation's run ends with an error naming the fix: {why}"
    );
    let _ = child.wait().await;
    reader.await.unwrap();

    let last = publish_round(&client, &category, round).await;
    applied(
        &log,
        &last,
        Duration::from_secs(60),
        "a round after the stalled one ended",
    )
    .await;
    let last_round: HashSet<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.payload.ends_with(&format!("/{round}")))
        .map(|r| r.instance.clone())
        .collect();
    assert_eq!(last_round, HashSet::from(["new".to_owned()]), "who ran the last round");
    assert_in_order(&log);
    new.stop.send(()).unwrap();
    new.run.await.unwrap().expect("the newer incarnation closes cleanly");
}
