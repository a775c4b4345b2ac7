-- Each claim of a notification gets a token of its own, and only the attempt holding the
-- latest token records an outcome: counting attempts could not tell an attempt that
-- outlived its lease from a fresh one after a retry reset the count.
ALTER TABLE confluo.notification ADD COLUMN claim uuid;

-- 0010 pinned the workflow's callback on running executions only; a failed one can run
-- again (a reprocess) and end again: pin it there too.
UPDATE confluo.execution e
   SET callback_url = w.definition ->> 'callback'
  FROM confluo.workflow w
 WHERE e.callback_url IS NULL AND e.status = 'failed'
   AND w.name = e.workflow_name AND w.version = e.workflow_version
   AND w.definition ? 'callback';
