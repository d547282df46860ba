"""The `coderunner` command: `up` (whole dev stack), `api`, `worker`."""
