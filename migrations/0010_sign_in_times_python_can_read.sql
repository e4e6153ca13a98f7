-- A session's last_signed_in_at is a moment of years 1-9999 in UTC, the range the job reads back.
--
-- A sign-in whose SignedInAt was a valid local time but no such moment (0001-01-01T00:00:00+03:00,
-- .NET's default(DateTime) on a Moscow server, is a moment of 1 BC) was applied before the
-- contract refused it: PostgreSQL stored it, and every later sign-in of that device failed on
-- reading it back and was dead-lettered. Such a value becomes the earliest moment the job can
-- read (it stays the device's earliest sign-in), and the check keeps any writer from storing
-- one again. NOT VALID, then VALIDATE: the scan takes no lock that blocks writers.

UPDATE user_activity.sessions
   SET last_signed_in_at = '0001-01-01 00:00:00+00'
 WHERE last_signed_in_at < '0001-01-01 00:00:00+00';
UPDATE user_activity.sessions
   SET last_signed_in_at = '9999-12-31 23:59:59.999999+00'
 WHERE last_signed_in_at > '9999-12-31 23:59:59.999999+00';

ALTER TABLE user_activity.sessions
    ADD CONSTRAINT chk_sessions_last_signed_in_at_readable
        CHECK (last_signed_in_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00')
        NOT VALID;
ALTER TABLE user_activity.sessions VALIDATE CONSTRAINT chk_sessions_last_signed_in_at_readable;
