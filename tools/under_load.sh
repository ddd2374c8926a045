#!/bin/sh
# Runs the command given with two busy loops beside it: the load of a shared CI machine, under which every
# deadline and every hand-off between threads comes later than on an idle one (make test-all runs the fault,
# fuzz and elastic tests so).
set -u
sh -c 'while :; do :; done' & first=$!
sh -c 'while :; do :; done' & second=$!
trap 'kill $first $second 2>/dev/null' EXIT INT TERM
"$@"
