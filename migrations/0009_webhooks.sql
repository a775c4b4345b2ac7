-- Webhooks through an outbox. An execution may name a URL to notify when it ends (its
-- workflow version may name a default one: the definition's "callback"). The notification
-- row is written by a trigger in the very transaction that moves the execution out of
-- 'running', whichever path ends it (its last stage firing, a failure, a cancel, its
-- deadline): it exists if and only if that end commits. Workers post it afterwards, at
-- least once, and record how it went here. An execution that runs again (a reprocess)
-- and ends again is announced again, with a notification of its own.
ALTER TABLE confluo.execution ADD COLUMN callback_url text;

CREATE TABLE confluo.notification (
    id              uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    execution_id    uuid        NOT NULL REFERENCES confluo.execution (id) ON DELETE CASCADE,
    url             text        NOT NULL,
    -- execution.completed, execution.failed, execution.cancelled, execution.timed_out
    event           text        NOT NULL,
    payload         jsonb       NOT NULL,
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    -- When a worker may (next) try it: a claim pushes it past the attempt's timeout, so
    -- that an attempt cut off by a dying worker is tried again by another.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- The last attempt: the HTTP status it got (if any), what went wrong (if anything).
    last_status     integer,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz
);

CREATE INDEX notification_due_idx ON confluo.notification (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX notification_execution_idx ON confluo.notification (execution_id);

CREATE FUNCTION confluo.notify_execution_end() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    target text;
BEGIN
    target := COALESCE(
        NEW.callback_url,
        (SELECT w.definition ->> 'callback' FROM confluo.workflow w
          WHERE w.name = NEW.workflow_name AND w.version = NEW.workflow_version));
    IF target IS NOT NULL THEN
        INSERT INTO confluo.notification (execution_id, url, event, payload)
        VALUES (NEW.id, target, 'execution.' || NEW.status,
                jsonb_build_object(
                    'execution_id', NEW.id,
                    'workflow', NEW.workflow_name,
                    'version', NEW.workflow_version,
                    'status', NEW.status,
                    'error', NEW.error,
                    'finished_at', NEW.finished_at));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER execution_end_notifies
    AFTER UPDATE OF status ON confluo.execution
    FOR EACH ROW
    WHEN (OLD.status = 'running' AND NEW.status <> 'running')
    EXECUTE FUNCTION confluo.notify_execution_end();
