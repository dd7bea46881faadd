"""Failure detection: classifier, restart policy, hang statistics, stack analysis (pure) and
health readings (the only part that reads the machine). See docs/failures.md."""

from unicron.detect.classify import RULES, classify, is_victim, root_cause
from unicron.detect.faults import Action, Classification, Fault, Severity
from unicron.detect.hang import HangDetector, HangVerdict, StepStats, Straggler
from unicron.detect.policy import Decision, FailureRecord, RestartPolicy, StopReason
from unicron.detect.stacks import CulpritReport, analyze_dump, name_culprits, parse_dump

__all__ = [
    "RULES", "Action", "Classification", "CulpritReport", "Decision", "FailureRecord", "Fault",
    "HangDetector", "HangVerdict", "RestartPolicy", "Severity", "StepStats", "StopReason", "Straggler",
    "analyze_dump", "classify", "is_victim", "name_culprits", "parse_dump", "root_cause",
]
