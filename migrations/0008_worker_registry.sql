-- The worker registry. A worker writes its row when it starts, refreshes it on every
-- housekeeping round (its heartbeat: what it runs and holds), and marks it when it stops.
-- A row whose heartbeat is more than three intervals old belongs to a worker that died
-- without stopping (SIGKILL, a lost host); any worker's housekeeping deletes the rows of
-- workers stopped or silent for an hour. Nothing on the task path reads this table.
CREATE TABLE confluo.worker (
    id            text        PRIMARY KEY,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    -- The confluo version the worker runs.
    version       text        NOT NULL,
    -- The (workflow, handler) pairs it serves: [{"workflow": ..., "handler": ...}].
    handlers      jsonb       NOT NULL,
    concurrency   integer     NOT NULL,
    -- Handlers running, and tasks held (running, waiting in the local queue, or ended and
    -- not yet acknowledged), at the last heartbeat.
    running       integer     NOT NULL DEFAULT 0,
    held          integer     NOT NULL DEFAULT 0,
    heartbeat_ms  bigint      NOT NULL CHECK (heartbeat_ms > 0),
    started_at    timestamptz NOT NULL DEFAULT now(),
    last_seen     timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);
