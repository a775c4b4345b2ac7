-- The auditor that runs by itself: every worker's housekeeping offers to run a round, and
-- the one whose UPDATE finds the last round old enough runs it (one worker at a time,
-- whatever their number, through a transaction pooler too: no session lock). A round
-- audits a slice of the running executions, the next ones after `cursor` in id order
-- (wrapping around), repairs what the repair can, and records what it could not.
CREATE TABLE confluo.auditor (
    -- One row.
    id           boolean     PRIMARY KEY DEFAULT true CHECK (id),
    -- The last execution the last round audited; NULL: the next round starts over.
    cursor       uuid,
    -- When the last round was claimed ('-infinity': never).
    round_at     timestamptz NOT NULL DEFAULT '-infinity',
    rounds       bigint      NOT NULL DEFAULT 0,
    -- Findings in all rounds, and those a repair moved on.
    found        bigint      NOT NULL DEFAULT 0,
    repaired     bigint      NOT NULL DEFAULT 0,
    -- What the rounds found and could not repair, still unrepaired when last audited:
    -- [{"execution_id": .., "finding": .., "at": ..}], at most 100.
    unrepaired   jsonb       NOT NULL DEFAULT '[]'
);
INSERT INTO confluo.auditor DEFAULT VALUES;
