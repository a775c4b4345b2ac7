-- An execution's callback is resolved when it starts (its own, else its workflow
-- version's), as the rest of its definition is pinned then: the trigger of 0009 no longer
-- reads the workflow table, and executions without a callback no longer run it at all
-- (the WHEN clause sees the column), so ending them costs what it did before webhooks.
UPDATE confluo.execution e
   SET callback_url = w.definition ->> 'callback'
  FROM confluo.workflow w
 WHERE e.callback_url IS NULL AND e.status = 'running'
   AND w.name = e.workflow_name AND w.version = e.workflow_version
   AND w.definition ? 'callback';

DROP TRIGGER execution_end_notifies ON confluo.execution;

CREATE OR REPLACE FUNCTION confluo.notify_execution_end() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO confluo.notification (execution_id, url, event, payload)
    VALUES (NEW.id, NEW.callback_url, 'execution.' || NEW.status,
            jsonb_build_object(
                'execution_id', NEW.id,
                'workflow', NEW.workflow_name,
                'version', NEW.workflow_version,
                'status', NEW.status,
                'error', NEW.error,
                'finished_at', NEW.finished_at));
    RETURN NULL;
END
$$;

CREATE TRIGGER execution_end_notifies
    AFTER UPDATE OF status ON confluo.execution
    FOR EACH ROW
    WHEN (OLD.status = 'running' AND NEW.status <> 'running' AND NEW.callback_url IS NOT NULL)
    EXECUTE FUNCTION confluo.notify_execution_end();
