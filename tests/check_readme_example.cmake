# Fails unless the example source appears verbatim in the README.
file(READ ${README} readme)
file(READ ${EXAMPLE} example)
string(FIND "${readme}" "${example}" where)
if(where EQUAL -1)
  message(FATAL_ERROR "README.md does not contain ${EXAMPLE} verbatim; paste it into the README")
endif()
