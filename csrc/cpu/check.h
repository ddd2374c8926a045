// MC_CHECK(cond, msg << values): throws std::invalid_argument with the values, not just the condition.
#pragma once

#include <sstream>
#include <stdexcept>

#define MC_CHECK(cond, stream_expr)                                  \
    do {                                                             \
        if (!(cond)) {                                               \
            std::ostringstream mc_check_os;                          \
            mc_check_os << stream_expr;                              \
            throw std::invalid_argument(mc_check_os.str());          \
        }                                                            \
    } while (0)
