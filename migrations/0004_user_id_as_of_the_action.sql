-- The rule for action_events.user_id, where the schema can say it (issue 14). Forward-only.
COMMENT ON COLUMN user_activity.action_events.user_id IS
    'Snapshot of the session''s user at the moment of the action: the session''s user_id only '
    'when the session was linked at or before the action (sessions.linked_at <= occurred_at; '
    'linked_at is the server clock at linking), else NULL. A guest action stays NULL after a '
    'later link and reaches the user''s history through the session (user_action_history).';
