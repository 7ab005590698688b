"""Traces, runs and reports for comparing policies on the same work."""
