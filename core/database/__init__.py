"""The database: its tables, engines and sessions, and every change of a row's state (a batch's
transitions, an upload's, the results log, API keys), each one conditional statement."""
