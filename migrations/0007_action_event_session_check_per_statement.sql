-- action_events.session_id checked once per statement instead of by a foreign key (issue 16).
-- Forward-only. Converts a database holding 0001-0006 data in place (no row is rewritten; the
-- rows already there were checked by the foreign key, dropped in the same transaction).
--
-- Why: the foreign key's check locks the referenced sessions row (SELECT ... FOR KEY SHARE) for
-- every inserted action. That lock is a WAL record per action (~55 B) and dirties the session's
-- page, so every sessions page touched after a checkpoint is written again as a full-page
-- image; together 5 % of the job's WAL per event. The rule stays the same and is enforced by
-- the database, now by triggers that take no row lock:
--
-- * an INSERT into action_events fails (SQLSTATE 23503 foreign_key_violation, as before) when
--   any of its rows names a session that does not exist: one anti-join per statement over the
--   statement's new rows (a transition table), after the rows are in;
-- * a DELETE of a session, or a change of its id, fails (23503) while an action references it.
--   It first takes a SHARE lock on action_events, so it waits for every transaction that is
--   inserting actions and then looks with a fresh snapshot; an insert that starts meanwhile
--   waits for it and, at READ COMMITTED (every writer here), its own check then sees the
--   deletion. A TRUNCATE of sessions fails while action_events has rows (TRUNCATE of
--   action_events itself is refused by 0001).
-- action_events rows are never updated (INV-ACT-001), so an UPDATE needs no check.

ALTER TABLE user_activity.action_events DROP CONSTRAINT action_events_session_id_fkey;

CREATE FUNCTION user_activity.check_action_event_sessions() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    missing uuid;
BEGIN
    SELECT n.session_id INTO missing
      FROM new_actions n
     WHERE NOT EXISTS (SELECT 1 FROM user_activity.sessions s WHERE s.id = n.session_id)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'insert into user_activity.action_events: session % does not exist',
                        missing
            USING ERRCODE = 'foreign_key_violation', SCHEMA = 'user_activity',
                  TABLE = 'action_events', COLUMN = 'session_id';
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER trg_action_events_session_exists
    AFTER INSERT ON user_activity.action_events
    REFERENCING NEW TABLE AS new_actions
    FOR EACH STATEMENT EXECUTE FUNCTION user_activity.check_action_event_sessions();

CREATE FUNCTION user_activity.refuse_referenced_session_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        IF EXISTS (SELECT 1 FROM user_activity.action_events) THEN
            RAISE EXCEPTION 'user_activity.sessions is referenced by action_events: TRUNCATE refused'
                USING ERRCODE = 'foreign_key_violation';
        END IF;
        RETURN NULL;
    END IF;
    -- wait for every transaction inserting actions; the query below then sees what they wrote
    LOCK TABLE user_activity.action_events IN SHARE MODE;
    IF EXISTS (SELECT 1 FROM user_activity.action_events e WHERE e.session_id = OLD.id) THEN
        RAISE EXCEPTION 'session % is referenced by user_activity.action_events: % refused',
                        OLD.id, TG_OP
            USING ERRCODE = 'foreign_key_violation', SCHEMA = 'user_activity',
                  TABLE = 'sessions', COLUMN = 'id';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER trg_sessions_referenced_delete
    BEFORE DELETE ON user_activity.sessions
    FOR EACH ROW EXECUTE FUNCTION user_activity.refuse_referenced_session_change();
CREATE TRIGGER trg_sessions_referenced_id_change
    BEFORE UPDATE OF id ON user_activity.sessions
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION user_activity.refuse_referenced_session_change();
CREATE TRIGGER trg_sessions_referenced_truncate
    BEFORE TRUNCATE ON user_activity.sessions
    FOR EACH STATEMENT EXECUTE FUNCTION user_activity.refuse_referenced_session_change();
