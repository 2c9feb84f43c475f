"""Powertools logger, tracer and metrics shared by every function (service name from env)."""

from aws_lambda_powertools import Logger, Metrics, Tracer

logger = Logger()
tracer = Tracer()
metrics = Metrics()
