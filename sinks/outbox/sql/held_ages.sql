-- Per topic with rows held back: seconds since its oldest row was held, and how many there are.
SELECT topic, extract(epoch FROM now() - min(held_at))::float8, count(*)
  FROM user_activity.outbox_held GROUP BY topic
