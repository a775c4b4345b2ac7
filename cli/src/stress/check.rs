//! The invariants, checked in the database at the end of a run with SQL of the harness's
//! own: not through the engine's bookkeeping (its audit included), so a bug there cannot
//! hide a violation here.

use sqlx::PgPool;

use super::handlers::AUDITS;

/// One invariant: its name, and what broke it (empty when it holds).
pub struct Check {
    pub name: &'static str,
    pub failures: Vec<String>,
}

async fn rows(pool: &PgPool, sql: &str) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar::<_, String>(sql).fetch_all(pool).await?)
}

/// Every check, each listing at most a few offending rows.
pub async fn all(pool: &PgPool, width: usize) -> anyhow::Result<Vec<Check>> {
    let mut checks = Vec::new();
    let mut add = |name, failures| checks.push(Check { name, failures });

    add(
        "every execution terminal",
        rows(
            pool,
            "SELECT id || ' is ' || status FROM confluo.execution
              WHERE status NOT IN ('completed', 'failed', 'cancelled', 'timed_out') LIMIT 5",
        )
        .await?,
    );
    add(
        "no task lost (none pending or running)",
        rows(
            pool,
            "SELECT id || ' is ' || status || ' in stage ' || stage_index FROM confluo.task_all
              WHERE status IN ('pending', 'running') LIMIT 5",
        )
        .await?,
    );
    add(
        "every map has all its members",
        rows(
            pool,
            &format!(
                "SELECT g.execution_id || ': ' || count(t.id) || ' members'
                   FROM confluo.stage_group g LEFT JOIN confluo.task_all t ON t.group_id = g.id
                  WHERE g.stage_index = 2
                  GROUP BY g.id HAVING count(t.id) <> {width} LIMIT 5"
            ),
        )
        .await?,
    );
    add(
        "every quorum map fired with its quorum completed, or failed its execution out of reach",
        rows(
            pool,
            "SELECT g.execution_id || ': ' || m.completed || ' completed, ' || m.dead
                    || ' dead of ' || g.width || ' for a quorum of ' || g.quorum
                    || CASE WHEN g.fired_at IS NULL THEN ', unfired' ELSE ', fired' END
                    || ', execution ' || e.status
               FROM confluo.stage_group g JOIN confluo.execution e ON e.id = g.execution_id
               JOIN LATERAL (
                    SELECT count(*) FILTER (WHERE t.status = 'completed') AS completed,
                           count(*) FILTER (WHERE t.status = 'dead') AS dead
                      FROM confluo.task_all t WHERE t.group_id = g.id) m ON true
              WHERE g.quorum IS NOT NULL
                AND CASE WHEN g.fired_at IS NOT NULL THEN m.completed < g.quorum
                         WHEN e.error LIKE '%can no longer fire%'
                         THEN m.dead <= g.width - g.quorum
                         ELSE e.status = 'completed' END
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every stage of a completed execution dispatched once, and fired",
        rows(
            pool,
            "SELECT e.id || ': ' || count(g.id) || ' groups, ' ||
                    count(g.fired_at) || ' fired'
               FROM confluo.execution e LEFT JOIN confluo.stage_group g ON g.execution_id = e.id
              WHERE e.status = 'completed'
              GROUP BY e.id
             HAVING count(g.id) <> CASE WHEN e.parent_execution IS NULL THEN 10 ELSE 1 END
                 OR count(g.fired_at) <> count(g.id)
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every group with all members terminal fired (running or completed executions)",
        rows(
            pool,
            "SELECT g.id || ' (stage ' || g.stage_index || ')' FROM confluo.stage_group g
               JOIN confluo.execution e ON e.id = g.execution_id
              WHERE e.status IN ('running', 'completed') AND g.fired_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM confluo.task_all t WHERE t.group_id = g.id
                                   AND t.status IN ('pending', 'running'))
              LIMIT 5",
        )
        .await?,
    );
    add(
        "no stage dispatched twice (the harness's own log of first members)",
        rows(
            pool,
            "SELECT execution_id || ' stage ' || stage_index || ': ' || count(*) || ' dispatches'
               FROM confluo_stress.started GROUP BY execution_id, stage_index
             HAVING count(*) > 1 LIMIT 5",
        )
        .await?,
    );
    add(
        "counters equal their non-terminal members",
        rows(
            pool,
            "SELECT g.id || ': counter ' || g.remaining || ', open ' || o.open
               FROM confluo.stage_group g
               JOIN LATERAL (SELECT count(*) FILTER (WHERE t.status IN ('pending', 'running')) AS open
                               FROM confluo.task_all t WHERE t.group_id = g.id) o ON true
              WHERE g.fan_in = 'countdown' AND g.remaining <> o.open
             UNION ALL
             SELECT s.group_id || ' stripe ' || s.stripe || ': counter ' || s.remaining
               FROM confluo.group_stripe s JOIN confluo.stage_group g ON g.id = s.group_id
              WHERE s.remaining <> (SELECT count(*) FROM confluo.task_all t
                                     WHERE t.group_id = s.group_id
                                       AND t.status IN ('pending', 'running')
                                       AND (t.item_index / g.stripe_run) % g.stripes = s.stripe)
             UNION ALL
             SELECT g.id || ': striped counter ' || g.remaining
               FROM confluo.stage_group g
              WHERE g.fan_in = 'striped'
                AND g.remaining <> (SELECT count(*) FROM confluo.group_stripe s
                                     WHERE s.group_id = g.id AND s.remaining > 0)
              LIMIT 5",
        )
        .await?,
    );
    add(
        "downstream saw every successful member's output, and nothing else",
        rows(
            pool,
            "SELECT s.execution_id || ' ' || s.handler || ': saw ' || s.outputs || ' outputs summing '
                    || s.total || ', members ' || m.completed || ' summing ' || m.total
                    || ', failed ' || s.failed || ' vs ' || m.failed
               FROM confluo_stress.seen s
               JOIN LATERAL (
                    SELECT count(*) FILTER (WHERE t.status = 'completed') AS completed,
                           COALESCE(sum((t.output)::bigint) FILTER (WHERE t.status = 'completed'), 0) AS total,
                           count(*) FILTER (WHERE t.status <> 'completed') AS failed
                      FROM confluo.task_all t WHERE t.execution_id = s.execution_id AND t.stage_index = 2
               ) m ON true
              WHERE s.outputs <> m.completed OR s.total <> m.total OR s.failed <> m.failed
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every completed execution took the one arm its left total's parity names",
        rows(
            pool,
            "SELECT e.id || ': took ' || COALESCE(b.branch ->> 'arm', 'nothing') || ', ran '
                    || COALESCE(a.arms, 'no arm') || ', left saw ' || COALESCE(s.totals, 'nothing')
               FROM confluo.execution e
               LEFT JOIN confluo.stage_group b ON b.execution_id = e.id AND b.kind = 'branch'
               LEFT JOIN LATERAL (SELECT string_agg(DISTINCT t.handler, ',') AS arms
                                    FROM confluo.task_all t
                                   WHERE t.execution_id = e.id AND t.handler IN ('even', 'odd')) a
                      ON true
               LEFT JOIN LATERAL (SELECT string_agg(DISTINCT s.total::text, ',') AS totals,
                                         min(s.total) AS total
                                    FROM confluo_stress.seen s
                                   WHERE s.execution_id = e.id AND s.handler = 'left') s
                      ON true
              WHERE e.status = 'completed' AND e.parent_execution IS NULL
                AND (b.branch ->> 'arm' IS DISTINCT FROM
                         CASE WHEN s.total % 2 = 0 THEN 'even' ELSE 'odd' END
                     OR a.arms IS DISTINCT FROM b.branch ->> 'arm'
                     OR s.totals LIKE '%,%')
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every completed execution's wait completed once: by its own signal or its timeout",
        rows(
            pool,
            "SELECT e.id || ': ' || count(t.id) || ' wait tasks, ' ||
                    string_agg(t.status || ' by ' || COALESCE(t.worker_id, '-') || ' with '
                               || COALESCE(t.output::text, '-'), '; ')
                    || ', kept ' || COALESCE(min(s.payload::text), 'nothing')
               FROM confluo.execution e
               JOIN confluo.stage_group g ON g.execution_id = e.id AND g.kind = 'signal'
               LEFT JOIN confluo.task_all t ON t.group_id = g.id
               LEFT JOIN confluo.signal s ON s.execution_id = e.id AND s.name = g.stage_name
               LEFT JOIN confluo.task_all u ON u.execution_id = e.id AND u.handler = 'total'
                    AND u.status = 'completed'
              WHERE e.status = 'completed'
              GROUP BY e.id
             HAVING count(t.id) <> 1
                 OR bool_or(t.status <> 'completed')
                 OR NOT bool_and(
                        CASE WHEN t.worker_id = 'confluo:signal'
                             THEN t.output = s.payload AND t.output ->> 'approved' = e.id::text
                             ELSE t.output = '{\"approved\": null}'::jsonb END)
                 OR min((u.output -> 0 -> 'wait')::text) IS DISTINCT FROM min(t.output::text)
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every completed execution's checks saw the map",
        rows(
            pool,
            "SELECT e.id::text FROM confluo.execution e
              WHERE e.status = 'completed' AND e.parent_execution IS NULL
                AND (SELECT count(DISTINCT handler) FROM confluo_stress.seen s
                      WHERE s.execution_id = e.id) <> 2
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every child started once for its member, which reports the child's end",
        rows(
            pool,
            &format!(
                "(SELECT t.id || ' (' || t.status || '): ' || count(c.id) || ' children, '
                        || COALESCE(string_agg(c.status, ','), 'none')
                   FROM confluo.task_all t
                   LEFT JOIN confluo.execution c ON c.parent_task = t.id
                   LEFT JOIN confluo.task_all a ON a.execution_id = c.id AND a.handler = 'audit'
                  WHERE t.handler = 'confluo:child'
                  GROUP BY t.id, t.status, t.execution_id, t.output
                 HAVING count(c.id) <> 1
                     OR bool_or(c.parent_execution IS DISTINCT FROM t.execution_id)
                     OR bool_or(t.status = 'completed' AND (c.status <> 'completed'
                                OR t.output IS DISTINCT FROM a.output))
                     OR bool_or(t.status = 'dead' AND c.status = 'completed')
                  LIMIT 5)
                 UNION ALL
                 (SELECT e.id || ': ' || count(t.id) || ' audit members'
                   FROM confluo.execution e
                   JOIN confluo.stage_group g ON g.execution_id = e.id AND g.kind = 'map_workflow'
                   LEFT JOIN confluo.task_all t ON t.group_id = g.id
                  GROUP BY e.id HAVING count(t.id) <> {AUDITS}
                  LIMIT 5)
                 UNION ALL
                 (SELECT c.id || ' has no member' FROM confluo.execution c
                  WHERE c.parent_execution IS NOT NULL
                    AND NOT EXISTS (SELECT 1 FROM confluo.task_all t WHERE t.id = c.parent_task)
                  LIMIT 5)"
            ),
        )
        .await?,
    );
    add(
        "every completed execution's audits received its total's requests",
        rows(
            pool,
            "SELECT c.id || ': audit of ' || c.input::text || ' gave ' || COALESCE(a.output::text, '-')
               FROM confluo.execution c
               JOIN confluo.task_all a ON a.execution_id = c.id AND a.handler = 'audit'
               JOIN confluo.task_all m ON m.id = c.parent_task
               JOIN confluo.task_all u ON u.execution_id = m.execution_id AND u.handler = 'total'
              WHERE c.status = 'completed'
                AND (c.input IS DISTINCT FROM u.output -> m.item_index
                     OR a.output IS DISTINCT FROM
                        jsonb_build_object('audited', m.item_index, 'wait', u.output -> 0 -> 'wait'))
              LIMIT 5",
        )
        .await?,
    );
    add(
        "every completed execution's total waited for its approval and its census, once",
        rows(
            pool,
            &format!(
                "SELECT e.id || ': total got ' || COALESCE(u.input::text, 'nothing') || ', joins '
                        || (SELECT count(*) FROM confluo.stage_join j WHERE j.execution_id = e.id)
                   FROM confluo.execution e
                   LEFT JOIN confluo.task_all u ON u.execution_id = e.id AND u.handler = 'total'
                   LEFT JOIN confluo.task_all w ON w.execution_id = e.id
                        AND w.handler = 'confluo:signal' AND w.status = 'completed'
                  WHERE e.status = 'completed' AND e.parent_execution IS NULL
                    AND (u.input IS DISTINCT FROM jsonb_build_object(
                             'approval', w.output, 'census', jsonb_build_object('width', {width}))
                         OR (SELECT count(*) FROM confluo.stage_join j
                              WHERE j.execution_id = e.id AND j.remaining = 0) <> 1
                         OR (SELECT count(*) FROM confluo.stage_join j
                              WHERE j.execution_id = e.id) <> 1)
                  LIMIT 5"
            ),
        )
        .await?,
    );
    Ok(checks)
}
