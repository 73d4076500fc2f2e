# Sourced by the compat scripts whose venvs hold no widget or notebook library: every test that needs neither, then
# benchmarks/gpu_check.py --device cpu --quick. Run from the repository's root.
#
#   run_tests_without_widgets PYTHON CHECK_JSON [pytest arguments...]
run_tests_without_widgets() {
  local python="$1" check_json="$2"
  shift 2
  # Not here: the widgets, the HTML report and the notebooks (they need plotly, ipywidgets, nbformat, nbclient).
  "$python" -m pytest -q -p no:cacheprovider -n 2 tests --ignore=tests/browser --ignore=tests/test_course.py \
    --ignore=tests/test_rerun_cells.py --ignore=tests/test_viz.py --ignore=tests/test_viz_properties.py \
    --ignore=tests/test_readme.py --ignore=tests/test_new_users.py \
    --deselect tests/test_bench.py::test_a_failed_mode_is_reported_and_the_others_kept \
    --deselect tests/test_bench.py::test_main_sweeps_rates_and_writes_html \
    --deselect tests/test_bench.py::test_report_from_saved_json \
    --deselect tests/test_prefix_cache.py::test_the_block_map_shows_shared_blocks_with_their_owners_and_reusable_blocks \
    "$@"
  "$python" benchmarks/gpu_check.py --device cpu --quick --out "$check_json"
}
