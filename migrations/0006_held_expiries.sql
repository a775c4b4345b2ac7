-- Crashes and the local queue. A worker claims tasks ahead of its handlers; when it dies,
-- the leases of every task it held expire, also those of tasks that were still waiting in
-- its local queue and never ran. Charging those an attempt made a crash-prone fleet
-- dead-letter tasks no handler had touched.
--
-- `started`: the worker reported that an attempt's handler started. A direct claim
-- (`Engine::claim`) hands the task to a caller that runs it now, so it is started at once;
-- a worker's claim is not, and the worker marks the tasks it started with its next lease
-- renewal (at most a second later), or acknowledges them before that.
--
-- `held_expiries`: how many times a lease expired on this task before any start was
-- reported, each given back without counting an attempt. The budget is small (see
-- `store/tasks.rs`): a task that crashes its worker before the worker can report it
-- started is charged from then on, so it still dead-letters instead of looping forever.
ALTER TABLE confluo.task
    ADD COLUMN started       boolean NOT NULL DEFAULT true,
    ADD COLUMN held_expiries integer NOT NULL DEFAULT 0;
