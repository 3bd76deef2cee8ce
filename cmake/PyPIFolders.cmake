# The PyPI cache's folders the tests use (scripts/pypi_cache.py: pinned
# wheels installed outside the checkout, a folder per requirements file).
# A test names each folder it needs as a fixture: reservoir_pypi_fixture()
# registers, once, the test pypi_NAME that installs the folder (nothing when
# it is complete), and ctest runs it before any test that requires it, and
# only then, even where a label or -R leaves it out. So `make test` installs
# what its own tests use, and each release's folders come with the first
# test that runs that release. They carry the label pypi, so that a run that
# selects tests by leaving labels out (-LE) leaves them out too (`-LE
# 'torch_extra|pypi'`) and gets each only as a fixture of what it runs.

# Sets OUT to the fixture of the folder REQUIREMENTS (a requirements file of
# scripts/pypi_cache.py) is installed into.
function(reservoir_pypi_fixture requirements out)
  get_filename_component(file ${requirements} NAME)
  string(REGEX REPLACE "^requirements-(.*)\\.txt$" "\\1" name "${file}")
  string(REGEX REPLACE "\\.txt$" "" name "${name}")
  set(test pypi_${name})
  get_property(known GLOBAL PROPERTY RESERVOIR_PYPI_FIXTURES)
  if(NOT test IN_LIST known)
    set_property(GLOBAL APPEND PROPERTY RESERVOIR_PYPI_FIXTURES ${test})
    add_test(NAME ${test} COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/scripts/pypi_cache.py ${requirements})
    # One download at a time: two PyTorch installs at once on 2 cores and
    # one link take longer than one after the other.
    set_tests_properties(${test} PROPERTIES FIXTURES_SETUP ${test} LABELS pypi TIMEOUT 3600
                         RESOURCE_LOCK pypi_cache ENVIRONMENT "RESERVOIR_PYPI_CACHE=${RESERVOIR_PYPI_CACHE}")
  endif()
  set(${out} ${test} PARENT_SCOPE)
endfunction()
