"""The work behind the routes (rules, rows, enqueueing), callable without HTTP."""
