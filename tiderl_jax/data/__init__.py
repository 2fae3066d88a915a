"""User data: datasets as a task source (`datasets`), reward functions and environments by import path
(`rewards`), built-in math and code rewards (`builtin`), the dataset tasks' environments (`env`)."""
