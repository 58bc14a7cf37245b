# `keel doctor hang DIR` on the dumps mpi_hang_dump_np4 left in DIR: it must exit 0, print the
# stuck all-reduce in the very words of the live watchdog report (which that test saved in
# DIR/live-report.txt), and name the rank that skipped it.
#   cmake -DKEEL=<keel binary> -DDIR=<dump directory> -P check_doctor_hang.cmake
execute_process(COMMAND ${KEEL} doctor hang ${DIR} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT code EQUAL 0)
  message(FATAL_ERROR "keel doctor hang ${DIR} exited with ${code}")
endif()
file(READ ${DIR}/live-report.txt live)
string(FIND "${out}" "hang: ${live} (stuck " at)
if(at EQUAL -1)
  message(FATAL_ERROR "the report lacks the live watchdog's line:\n  hang: ${live}")
endif()
string(FIND "${out}" "world rank 3 skipped it" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the report does not say that world rank 3 skipped the all-reduce")
endif()
