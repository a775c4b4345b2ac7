//! Fan-in inputs without a ceiling: the stage after a wide map reads its members page by
//! page; an input too large to load is refused with a message that says what to do; a
//! map has a documented maximum width.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{fast_retry, quick_worker, TestDb, WAIT};
use confluo::{Error, ExecutionStatus, MapResults, Stage, TaskError, Workflow, MAX_MAP_WIDTH};
use futures_util::TryStreamExt;
use serde_json::json;

/// 4 KB of text that differs for every member (so PostgreSQL cannot compress it away).
fn payload(i: u64) -> String {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// What the step after the map saw.
#[derive(Debug, Default)]
struct Seen {
    withheld: Option<String>,
    members: u64,
    in_order: bool,
    intact: bool,
    largest_page: usize,
}

/// 100 000 members with 4 KB outputs each (400 MB in all, past PostgreSQL's ~256 MB
/// ceiling on one jsonb value): the next step cannot get them as one input, and reads
/// every member page by page instead. `CONFLUO_TEST_QUICK=1` runs 10 000 (40 MB, still
/// past the default inline limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_step_after_a_100_000_wide_map_of_4_kb_outputs_reads_every_member() {
    let width: u64 = if std::env::var_os("CONFLUO_TEST_QUICK").is_some() {
        10_000
    } else {
        100_000
    };
    let db = TestDb::new(12).await;
    db.register(
        &Workflow::new("wide", 1)
            .map("each")
            .stage(Stage::step("total").retry(fast_retry(1))),
    )
    .await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let seen2 = seen.clone();
    let worker = quick_worker(&db.engine, move |w| {
        w.concurrency(16)
            .handler("wide", "each", |t| async move {
                let i: u64 = t.input_as()?;
                Ok::<_, TaskError>(json!({"i": i, "data": payload(i)}))
            })
            .handler("wide", "total", move |t| {
                let seen = seen2.clone();
                async move {
                    let withheld = t
                        .input_as::<MapResults>()
                        .err()
                        .map(|e| e.message().to_owned());
                    let block = t.previous_block().expect("the stage follows a map").clone();
                    let mut pages = 0usize;
                    let mut members = 0u64;
                    let mut in_order = true;
                    let mut intact = true;
                    let mut largest_page = 0;
                    let mut after = None;
                    loop {
                        let page = block
                            .page(after, 1_000)
                            .await
                            .map_err(TaskError::retryable)?;
                        if page.is_empty() {
                            break;
                        }
                        pages += 1;
                        largest_page = largest_page.max(page.len());
                        for m in &page {
                            in_order &= u64::from(m.index) == members;
                            let output = m.output.as_ref();
                            intact &= m.status == "completed"
                                && output.and_then(|o| o["i"].as_u64()) == Some(members)
                                && output.and_then(|o| o["data"].as_str())
                                    == Some(payload(members).as_str());
                            members += 1;
                        }
                        after = page.last().map(|m| m.index);
                    }
                    *seen.lock().unwrap() = Seen {
                        withheld,
                        members,
                        in_order,
                        intact,
                        largest_page,
                    };
                    Ok::<_, TaskError>(json!({"members": members, "pages": pages}))
                }
            })
    })
    .await;
    let items: Vec<u64> = (0..width).collect();
    let started = Instant::now();
    let id = db.engine.start("wide", &items).await.unwrap();
    let done = db
        .engine
        .wait(id, WAIT.max(Duration::from_secs(600)))
        .await
        .unwrap();
    worker.shutdown().await;
    eprintln!(
        "{width} members of 4 KB: {:?} end to end",
        started.elapsed()
    );
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    let seen = seen.lock().unwrap();
    let withheld = seen
        .withheld
        .as_deref()
        .expect("the whole input was not loaded");
    assert!(
        withheld.contains("previous_block") && withheld.contains("inline_block_input"),
        "{withheld}"
    );
    assert_eq!(seen.members, width);
    assert!(seen.in_order && seen.intact);
    assert_eq!(seen.largest_page, 1_000);
    assert_eq!(
        done.output.as_ref().map(|o| o["members"].clone()),
        Some(json!(width))
    );
}

/// The input as loaded (if it was), and the members as paged.
type Paged = (Option<MapResults>, Vec<confluo::BlockMember>);

/// Under the limit, the input is loaded as before, and the members can be paged as well;
/// with a limit of one byte, the same step is told to page, and the stream of members
/// (`BlockOutputs::members`) gives the same members with their failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_blocks_are_loaded_and_paged_alike() {
    let db = TestDb::new(10).await;
    db.register(
        &Workflow::new("small", 1)
            .stage(Stage::map("each").retry(fast_retry(1)))
            .step("total"),
    )
    .await;
    for limit in [confluo::DEFAULT_INLINE_BLOCK_INPUT, 1] {
        let seen: Arc<Mutex<Option<Paged>>> = Arc::default();
        let seen2 = seen.clone();
        let worker = quick_worker(&db.engine, move |w| {
            w.inline_block_input(limit)
                .handler("small", "each", |t| async move {
                    let i: u32 = t.input_as()?;
                    if i == 3 {
                        return Err(TaskError::permanent("three is refused"));
                    }
                    Ok(i * 10)
                })
                .handler("small", "total", move |t| {
                    let seen = seen2.clone();
                    async move {
                        let loaded = t.input_as::<MapResults>().ok();
                        let block = t.previous_block().expect("after a map");
                        // Pages of 2 over 7 members: the stream crosses page ends.
                        let members: Vec<_> = block
                            .members(2)
                            .try_collect()
                            .await
                            .map_err(TaskError::retryable)?;
                        *seen.lock().unwrap() = Some((loaded, members));
                        Ok::<_, TaskError>(())
                    }
                })
        })
        .await;
        let id = db
            .engine
            .start("small", &(0..7).collect::<Vec<u32>>())
            .await
            .unwrap();
        let done = db.engine.wait(id, WAIT).await.unwrap();
        worker.shutdown().await;
        assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
        let (loaded, members) = seen.lock().unwrap().take().expect("total ran");
        match limit {
            1 => assert!(loaded.is_none(), "a one-byte limit withholds the input"),
            _ => {
                let loaded = loaded.expect("under the limit the input is loaded");
                assert_eq!(loaded.outputs, [0, 10, 20, 40, 50, 60].map(|v| json!(v)));
                assert_eq!(loaded.failed.len(), 1);
            }
        }
        let indexes: Vec<u32> = members.iter().map(|m| m.index).collect();
        assert_eq!(indexes, (0..7).collect::<Vec<_>>());
        let three = &members[3];
        assert_eq!(
            (three.status.as_str(), three.output.as_ref()),
            ("dead", None)
        );
        assert_eq!(three.error.as_deref(), Some("three is refused"));
        assert_eq!(members[6].output, Some(json!(60)));

        // The same members from the engine, after the execution ended.
        let block = db.engine.block_outputs(id, 0).await.unwrap();
        assert_eq!(
            block.page(Some(5), 10).await.unwrap(),
            members[6..].to_vec()
        );
    }
    let unknown = confluo::ExecutionId(uuid::Uuid::new_v4());
    assert!(matches!(
        db.engine.block_outputs(unknown, 0).await,
        Err(Error::ExecutionNotFound(_))
    ));
}

/// A map has at most `MAX_MAP_WIDTH` members: a longer input is refused at start, and
/// nothing is written; a step that returns a longer array to a map fails its attempt
/// with a message naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_map_wider_than_the_maximum_is_refused() {
    let db = TestDb::new(10).await;
    db.register(&Workflow::new("too-wide", 1).map("each")).await;
    db.register(
        &Workflow::new("too-wide-later", 1)
            .stage(Stage::step("list").retry(fast_retry(1)))
            .map("each"),
    )
    .await;
    let items = vec![0u8; MAX_MAP_WIDTH + 1];
    match db.engine.start("too-wide", &items).await {
        Err(error @ Error::MapTooWide { width, max, .. }) => {
            assert_eq!((width, max), (MAX_MAP_WIDTH + 1, MAX_MAP_WIDTH));
            assert!(error.to_string().contains("split the input"), "{error}");
        }
        other => panic!("expected MapTooWide, got {other:?}"),
    }
    let executions: i64 = sqlx::query_scalar("SELECT count(*) FROM confluo.execution")
        .fetch_one(&mut db.connection().await)
        .await
        .unwrap();
    assert_eq!(executions, 0, "nothing was started");

    let worker = quick_worker(&db.engine, |w| {
        w.handler("too-wide-later", "list", |_| async {
            Ok::<_, TaskError>(vec![0u8; MAX_MAP_WIDTH + 1])
        })
        .handler("too-wide-later", "each", |_| async {
            Ok::<_, TaskError>(())
        })
    })
    .await;
    let id = db.engine.start("too-wide-later", &()).await.unwrap();
    let done = db.engine.wait(id, WAIT).await.unwrap();
    worker.shutdown().await;
    assert_eq!(done.status, ExecutionStatus::Failed, "{done:?}");
    let error = &done.dead_letters[0].errors[0].error;
    assert!(error.contains("at most 1000000 members"), "{error}");
}
