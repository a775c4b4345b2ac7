//! A wide map's members through the API: page by page in item order, by status, and one
//! member in full.

mod common;

use std::time::Duration;

use axum::http::{Method, StatusCode};
use axum::Router;
use common::{assert_error, call, engine, local};
use confluo::{ExecutionId, ExecutionStatus, TaskError, Workflow};
use serde_json::{json, Value};

/// A wide map's members page by page, in item order, with and without a status filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_page_by_page() {
    let engine = engine("confluo_serve_members").await;
    engine
        .register(
            &Workflow::new("wide", 1)
                .stage(confluo::Stage::map("item"))
                .step("sum"),
        )
        .await
        .unwrap();
    let worker = engine
        .worker()
        .concurrency(16)
        .handler("wide", "item", |t| async move {
            let item: u32 = t.input_as()?;
            if item % 50 == 49 {
                Err(TaskError::permanent(format!("item {item} is broken")))
            } else {
                Ok(json!(item))
            }
        })
        .handler("wide", "sum", |_| async { Ok(json!("summed")) })
        .start()
        .await
        .unwrap();
    let id = engine
        .start("wide", &(0..250).collect::<Vec<u32>>())
        .await
        .unwrap();
    let done = engine.wait(id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, ExecutionStatus::Completed, "{done:?}");
    worker.shutdown().await;
    let app = confluo_serve::router(engine.clone(), &local()).unwrap();

    // The last hour's activity: every task by status, per minute, one hand-over.
    let (_, stats) = call(&app, Method::GET, "/api/v1/stats", None).await;
    let activity = &stats["activity"];
    assert_eq!(
        activity["tasks"],
        json!({"pending": 0, "running": 0, "completed": 246, "dead": 5, "cancelled": 0}),
        "{stats}"
    );
    let per_minute = activity["per_minute"].as_array().unwrap();
    let sum = |key: &str| -> u64 { per_minute.iter().map(|m| m[key].as_u64().unwrap()).sum() };
    assert_eq!((sum("completed"), sum("dead")), (246, 5), "{stats}");
    assert_eq!(activity["hand_over"]["groups"], 1, "{stats}");
    assert!(
        activity["hand_over"]["in_firing_transaction"].as_u64() <= Some(1),
        "{stats}"
    );
    let p50 = activity["hand_over"]["p50_ms"].as_f64().unwrap();
    assert!((0.0..60_000.0).contains(&p50), "{stats}");

    // The server samples the queue's depth from the router's start (then every 15 s).
    let mut history = Value::Null;
    for _ in 0..100 {
        history = call(&app, Method::GET, "/api/v1/stats", None).await.1["queue_history"].clone();
        if !history.as_array().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        (history[0]["due"].clone(), history[0]["running"].clone()),
        (json!(0), json!(0)),
        "{history}"
    );
    assert!(history[0]["at"].is_string(), "{history}");

    let base = format!("/api/v1/executions/{id}/stages/0/members");

    let mut seen = Vec::new();
    let mut after: Option<u64> = None;
    let mut pages = 0;
    loop {
        let uri = match after {
            Some(a) => format!("{base}?limit=100&after={a}"),
            None => format!("{base}?limit=100"),
        };
        let (status, page) = call(&app, Method::GET, &uri, None).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        pages += 1;
        let members = page["members"].as_array().unwrap();
        seen.extend(members.iter().map(|m| m["item_index"].as_u64().unwrap()));
        match page["next_after"].as_u64() {
            Some(next) => {
                assert_eq!(Some(next), seen.last().copied(), "{page}");
                after = Some(next);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, (0..250).collect::<Vec<u64>>());

    let (_, dead) = call(&app, Method::GET, &format!("{base}?status=dead"), None).await;
    let dead: Vec<u64> = dead["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["status"], "dead", "{m}");
            assert!(m["last_error"].as_str().unwrap().contains("is broken"));
            m["item_index"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(dead, vec![49, 99, 149, 199, 249]);
    let (_, later) = call(
        &app,
        Method::GET,
        &format!("{base}?status=dead&after=149&limit=1"),
        None,
    )
    .await;
    assert_eq!(later["members"][0]["item_index"], 199, "{later}");
    assert_eq!(later["next_after"], 199, "{later}");
    // A member in full, whatever its status.
    let (_, first_page) = call(&app, Method::GET, &format!("{base}?limit=1"), None).await;
    let task = first_page["members"][0]["task_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, member) = call(&app, Method::GET, &format!("/api/v1/tasks/{task}"), None).await;
    assert_eq!(status, StatusCode::OK, "{member}");
    assert_eq!(
        (
            member["status"].clone(),
            member["input"].clone(),
            member["output"].clone()
        ),
        (json!("completed"), json!(0), json!(0)),
        "{member}"
    );
    assert_eq!(member["errors"], json!([]), "{member}");
    let dead_task = dead_members_first_task(&app, &base).await;
    let (_, dead_member) = call(
        &app,
        Method::GET,
        &format!("/api/v1/tasks/{dead_task}"),
        None,
    )
    .await;
    assert_eq!(dead_member["status"], "dead", "{dead_member}");
    assert_eq!(
        dead_member["errors"][0]["error"], "item 49 is broken",
        "{dead_member}"
    );
    let unknown = call(
        &app,
        Method::GET,
        &format!("/api/v1/tasks/{}", ExecutionId::new()),
        None,
    )
    .await;
    assert_error(&unknown, StatusCode::NOT_FOUND, "task_not_found");

    let bad = call(&app, Method::GET, &format!("{base}?status=asleep"), None).await;
    assert_error(&bad, StatusCode::BAD_REQUEST, "bad_request");
    // A stage never entered has no members; an unknown execution is a 404.
    let (status, none) = call(
        &app,
        Method::GET,
        &format!("/api/v1/executions/{id}/stages/5/members"),
        None,
    )
    .await;
    assert_eq!(
        (status, none),
        (StatusCode::OK, json!({"members": [], "next_after": null}))
    );
}

async fn dead_members_first_task(app: &Router, base: &str) -> String {
    let (_, page) = call(
        app,
        Method::GET,
        &format!("{base}?status=dead&limit=1"),
        None,
    )
    .await;
    page["members"][0]["task_id"].as_str().unwrap().to_owned()
}
