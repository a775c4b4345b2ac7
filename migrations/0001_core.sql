-- confluo core schema. Every statement names the `confluo` schema explicitly, so the
-- application's own search_path never matters. Landed migrations are never edited:
-- changes go into new files.

-- A registered workflow definition. Executions are pinned to (name, version).
CREATE TABLE confluo.workflow (
    name        text        NOT NULL,
    version     integer     NOT NULL CHECK (version > 0),
    definition  jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);

-- One run of a workflow. Touched once per stage transition, never per member completion.
CREATE TABLE confluo.execution (
    id               uuid        PRIMARY KEY,
    workflow_name    text        NOT NULL,
    workflow_version integer     NOT NULL,
    status           text        NOT NULL DEFAULT 'running'
                     CHECK (status IN ('running', 'completed', 'failed', 'cancelled')),
    input            jsonb       NOT NULL,
    idempotency_key  text,
    current_stage    integer     NOT NULL DEFAULT 0,
    -- The group whose output is the execution's output (read by reference).
    output_group     uuid,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    FOREIGN KEY (workflow_name, workflow_version) REFERENCES confluo.workflow (name, version),
    UNIQUE (workflow_name, idempotency_key)
);

CREATE INDEX execution_status_idx ON confluo.execution (workflow_name, status, created_at);

-- The countdown row of one stage of one execution (a step is a group of width 1).
-- Created in the same transaction as its tasks; `remaining` counts members that are not
-- terminal (completed, dead or cancelled). The transaction that takes it to 0 fires it.
CREATE TABLE confluo.stage_group (
    id            uuid        PRIMARY KEY,
    execution_id  uuid        NOT NULL REFERENCES confluo.execution (id) ON DELETE CASCADE,
    stage_index   integer     NOT NULL CHECK (stage_index >= 0),
    stage_name    text        NOT NULL,
    kind          text        NOT NULL CHECK (kind IN ('step', 'parallel', 'map')),
    width         integer     NOT NULL CHECK (width >= 0),
    remaining     integer     NOT NULL CHECK (remaining >= 0 AND remaining <= width),
    fired_at      timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Second guard on dispatch: a stage can be entered once per execution.
    UNIQUE (execution_id, stage_index)
) WITH (fillfactor = 50);

-- One member of a group: one attempt at a time, fenced by its lease token.
CREATE TABLE confluo.task (
    id               uuid        PRIMARY KEY,
    execution_id     uuid        NOT NULL REFERENCES confluo.execution (id) ON DELETE CASCADE,
    group_id         uuid        NOT NULL REFERENCES confluo.stage_group (id) ON DELETE CASCADE,
    workflow_name    text        NOT NULL,
    workflow_version integer     NOT NULL,
    stage_index      integer     NOT NULL,
    -- The handler that runs it: the stage name, or the branch name in a parallel stage.
    handler          text        NOT NULL,
    item_index       integer     NOT NULL,
    -- NULL: the stage's input, resolved by reference when claimed (the execution input for
    -- stage 0, else the previous stage's output). Map members carry their element.
    input            jsonb,
    status           text        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'running', 'completed', 'dead', 'cancelled')),
    priority         integer     NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    attempt          integer     NOT NULL DEFAULT 0,
    -- The retry policy, persisted so that it survives any process.
    max_attempts     integer     NOT NULL CHECK (max_attempts > 0),
    backoff_base_ms  bigint      NOT NULL,
    backoff_max_ms   bigint      NOT NULL,
    backoff_jitter   double precision NOT NULL,
    timeout_ms       bigint      NOT NULL,
    -- The token of the latest attempt: kept after a terminal transition, so that a replayed
    -- acknowledgement can be told from a stale one.
    lease_token      uuid,
    lease_expires_at timestamptz,
    worker_id        text,
    output           jsonb,
    -- Every attempt's error, oldest first: [{"attempt": n, "error": "...", "at": ...}].
    errors           jsonb       NOT NULL DEFAULT '[]',
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    UNIQUE (group_id, item_index)
);

-- Claiming: priority, then due time; tasks in backoff sit behind `run_at` in the index.
CREATE INDEX task_claim_idx ON confluo.task (priority DESC, run_at) WHERE status = 'pending';
-- Reclaiming expired leases.
CREATE INDEX task_lease_idx ON confluo.task (lease_expires_at) WHERE status = 'running';
CREATE INDEX task_execution_idx ON confluo.task (execution_id, status);
